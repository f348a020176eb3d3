"""The instrument's view of a DeviceMesh: the Meter's traffic, per mesh dimension."""

from common.messages import log
from common.report import fmt_bytes


def traffic_per_mesh_dimension(meter, mesh):
    """What each dimension of `mesh` carried per step, as the Meter counted it per process group.

    Every dimension of size > 1 has its own process group (a rank belongs to one per dimension),
    so the group's name tells the dimension; a group that is none of the mesh's is shown by name.
    Logs a table on rank 0 and returns the RESULT fields `mesh` ({dimension: size}) and
    `comm_by_dim` ({dimension: {kind: [calls in the Meter's window, bytes per step]}})."""
    dimension_of_group = {}
    for dim in mesh.mesh_dim_names:
        if mesh[dim].size() > 1:
            dimension_of_group[mesh.get_group(dim).group_name] = dim
    comm_by_dim = {}
    for group_name, kinds in meter.comm_by_group().items():
        dim = dimension_of_group.get(group_name, f"group {group_name}")
        comm_by_dim[dim] = kinds
    lines = ["", "communication per mesh dimension, per step (calls in the Meter's window)"]
    for dim, kinds in sorted(comm_by_dim.items()):
        cells = []
        for kind, (calls, nbytes) in sorted(kinds.items()):
            cells.append(f"{kind} {fmt_bytes(nbytes)} ({calls})")
        lines.append(f"  {dim:<14}" + ", ".join(cells))
    log("\n".join(lines))
    sizes = {dim: mesh[dim].size() for dim in mesh.mesh_dim_names}
    return dict(mesh=sizes, comm_by_dim=comm_by_dim)
