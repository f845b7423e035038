"""YAML scenario files -> frozen ``Scenario`` records. Every error names the file, line and key.

Format (the key names are the contract):

    defaults: {...}          # optional: any scenario key except name; scenarios inherit them
    scenarios:
      - name: ...            # unique, [A-Za-z0-9._-]
        op: attention
        batch, heads_q, heads_kv, kv_map, n_q, n_k, d_head, d_value, scale
        mask: {causal, window, key_lengths, visible}
        loss_rows: [...]
        check: {mode, samples, directions}
        dtype, epsilon, tolerance, seed

The package, one module per concern (imports run one way, from the bottom up): ``yaml_lines`` (YAML with
line numbers), ``fields`` (the keys, their limits and typed readers), ``sweep``, ``model`` (the
``Scenario`` record), ``resources`` (memory), ``parse`` (one scenario: the common keys, then the op's:
its ``Param``s and the key group it shares and parses itself, ``Op.shared_keys``, as attention's heads, sizes and
masks in ``ops.attention.scenario_keys``), ``loader`` (files and lists of scenarios) and ``schema`` (the JSON
Schema).
"""
from .fields import (
                     ATTENTION_KEYS,
                     BACKEND_KEYS,
                     BACKENDS,
                     CHECK_KEYS,
                     COMMON_KEYS,
                     DEVICES,
                     ENGINES,
                     LOW_PRECISION,
                     MASK_KEYS,
                     MAX_DIRECTIONS,
                     MAX_EPSILON,
                     MAX_FACTOR,
                     MAX_SCALE,
                     MAX_SLACK,
                     MAX_TOLERANCE,
                     MODES,
                     NAME_RE,
                     NESTED,
                     SCENARIO_KEYS,
                     TOP_KEYS,
)
from .loader import load, loads, read_files, select, with_engine
from .model import Scenario, default_kv_map
from .resources import available_memory, cgroup_room, need
from .schema import json_schema
from .sweep import MAX_SWEEP_CASES
from .yaml_lines import MAX_VALUES, SAFE_TAGS

__all__ = [
    "Scenario", "default_kv_map", "load", "loads", "read_files", "select", "with_engine", "json_schema",
    "available_memory", "cgroup_room", "need",
    "ATTENTION_KEYS", "BACKEND_KEYS", "BACKENDS", "CHECK_KEYS", "COMMON_KEYS", "DEVICES", "ENGINES", "LOW_PRECISION",
    "MASK_KEYS", "MAX_DIRECTIONS", "MAX_EPSILON", "MAX_SCALE", "MAX_SWEEP_CASES", "MAX_TOLERANCE",
    "MAX_FACTOR", "MAX_SLACK", "MAX_VALUES",
    "MODES", "NAME_RE", "NESTED", "SAFE_TAGS", "SCENARIO_KEYS", "TOP_KEYS",
]
