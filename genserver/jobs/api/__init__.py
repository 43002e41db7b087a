"""The REST API: serializers, one view per endpoint, routes, and the error format."""
