"""Every environment variable vserve reads, typed, in one place."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Env:
    log_level: str                 # VSERVE_LOG_LEVEL: log level of engine and worker processes
    engine_ready_timeout: float    # VSERVE_ENGINE_READY_TIMEOUT: seconds to wait for start-up
    dist_timeout: float            # VSERVE_DIST_TIMEOUT: torch.distributed op timeout (s)
    fault_inject: str | None       # VSERVE_FAULT_INJECT="execute_model:N": raise at step N
                                   # (testing hook for failure handling)
    api_key: str | None            # VSERVE_API_KEY: server API key when --api-key is absent
    pp_layer_partition: str | None  # VSERVE_PP_LAYER_PARTITION="10,8": decoder layers per
                                    # pipeline stage, first to last (default: by cost)


def read_env() -> Env:
    return Env(
        log_level=os.environ.get("VSERVE_LOG_LEVEL", "WARNING"),
        engine_ready_timeout=float(os.environ.get("VSERVE_ENGINE_READY_TIMEOUT", 600)),
        dist_timeout=float(os.environ.get("VSERVE_DIST_TIMEOUT", 1800)),
        fault_inject=os.environ.get("VSERVE_FAULT_INJECT") or None,
        api_key=os.environ.get("VSERVE_API_KEY") or None,
        pp_layer_partition=os.environ.get("VSERVE_PP_LAYER_PARTITION") or None,
    )


ENV = read_env()
