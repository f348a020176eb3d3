"""The instrument's view of a DeviceMesh: the Meter's traffic, per mesh dimension."""

from common.messages import log
from common.report import fmt_bytes


def traffic_per_mesh_dimension(meter, mesh):
    """What each dimension of `mesh` carried per step, as the Meter counted it per process group:
    logs a table on rank 0 and returns the RESULT fields `mesh` ({dimension: size}) and
    `comm_by_dim` ({dimension: {kind: [calls in the Meter's window, bytes per step]}})."""
    comm_by_dim = comm_by_mesh_dimension(meter, mesh)
    log_comm_by_dim(comm_by_dim)
    sizes = {dim: mesh[dim].size() for dim in mesh.mesh_dim_names}
    return dict(mesh=sizes, comm_by_dim=comm_by_dim)


def comm_by_mesh_dimension(meter, mesh):
    """The Meter's {process group name: traffic}, keyed by mesh dimension instead. The Meter sees
    only process groups; a DeviceMesh gives each dimension its own group (a rank is in one per
    dimension), so a group's name tells its dimension. Dimensions of size 1 carry nothing; a group
    that is none of the mesh's keeps its name."""
    dimension_of_group = {}
    for dim in mesh.mesh_dim_names:
        if mesh[dim].size() > 1:
            dimension_of_group[mesh.get_group(dim).group_name] = dim
    comm_by_dim = {}
    for group_name, traffic in meter.comm_by_group().items():
        dim = dimension_of_group.get(group_name, f"group {group_name}")
        comm_by_dim[dim] = traffic
    return comm_by_dim


def log_comm_by_dim(comm_by_dim):
    """One line a dimension: each kind's bytes per step, with its calls in the Meter's window."""
    lines = ["", "communication per mesh dimension, per step (calls in the Meter's window)"]
    for dim, traffic in sorted(comm_by_dim.items()):
        cells = []
        for kind, (calls, nbytes) in sorted(traffic.items()):
            cells.append(f"{kind} {fmt_bytes(nbytes)} ({calls})")
        lines.append(f"  {dim:<14}" + ", ".join(cells))
    log("\n".join(lines))
