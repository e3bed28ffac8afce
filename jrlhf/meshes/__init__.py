"""Named meshes over device slices and logical-axis rule sets per role and phase."""

from jrlhf.meshes.context import activation_sharding, constrain, current_mesh
from jrlhf.meshes.mesh import MeshSpec, blame_setting, make_mesh, mesh_devices
from jrlhf.meshes.rules import (
    DP_TP,
    FSDP_TP,
    MESH_AXES,
    PHASE_RULES,
    REPLICATED,
    RULE_SETS,
    MeshLayoutError,
    Rules,
    get_rules,
    logical_to_spec,
    named_sharding,
    path_str,
    tree_shardings,
)

__all__ = [
    "DP_TP",
    "FSDP_TP",
    "MESH_AXES",
    "PHASE_RULES",
    "REPLICATED",
    "RULE_SETS",
    "MeshLayoutError",
    "MeshSpec",
    "Rules",
    "activation_sharding",
    "blame_setting",
    "constrain",
    "current_mesh",
    "get_rules",
    "logical_to_spec",
    "make_mesh",
    "mesh_devices",
    "named_sharding",
    "path_str",
    "tree_shardings",
]
