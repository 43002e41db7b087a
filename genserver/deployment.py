"""This deployment's scheduling objects, built once from settings: registry, thresholds, limits, layout."""

from __future__ import annotations

from functools import lru_cache

from django.conf import settings

from genserver.registry import Registry, load_registry
from genserver.scheduling.admission import AdmissionLimits
from genserver.scheduling.classes import ClassThresholds
from genserver.scheduling.overload import LongCapPolicy
from genserver.scheduling.pools import PoolLayout, detect_gpus, load_layout


@lru_cache(maxsize=1)
def registry() -> Registry:
    return load_registry(settings.REGISTRY_PATH)


@lru_cache(maxsize=1)
def thresholds() -> ClassThresholds:
    return ClassThresholds(short=settings.CLASS_SHORT_SECONDS, medium=settings.CLASS_MEDIUM_SECONDS)


@lru_cache(maxsize=1)
def limits() -> AdmissionLimits:
    return AdmissionLimits(
        short=settings.ADMIT_SHORT_SECONDS, medium=settings.ADMIT_MEDIUM_SECONDS, long=settings.ADMIT_LONG_SECONDS
    )


def long_cap_policy() -> LongCapPolicy | None:
    """The overload cap's rule (GENSERVER_LONG_CAP_ENGAGE / _RELEASE); None when it is off."""
    if not settings.LONG_CAP_ENGAGE_SHARE:
        return None
    return LongCapPolicy(settings.LONG_CAP_ENGAGE_SHARE, settings.LONG_CAP_RELEASE_SHARE)


def num_gpus() -> int:
    return int(settings.NUM_GPUS) if settings.NUM_GPUS not in (None, "") else detect_gpus()


@lru_cache(maxsize=1)
def layout() -> PoolLayout:
    return load_layout(
        settings.POOLS,
        num_gpus(),
        settings.CPU_WORKERS,
        settings.IMAGE_CARDS,
        settings.MAX_LONG_CARDS,
        settings.GROUP_CARDS,
    )


def clock_scale(backend: str) -> float:
    """Wall seconds per second of modelled work: the simulated backend runs compressed."""
    return settings.TIME_SCALE if backend == "simulated" else 1.0
