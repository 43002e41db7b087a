"""Jobs: the model, the job service (writes), selectors (reads), the API and the admin."""
