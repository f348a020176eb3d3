"""What every technique script shares and no technique changes, one concern a module:

    messages.py  log a line from rank 0, or fail with one clear error
    launch.py    the shared flags, the launcher (torchrun or --nproc), the backend and device
    data.py      MNIST or the synthetic digits as Datasets, the exact evaluation loader
    model.py     the Vision Transformer every script trains
    moe.py       its mixture-of-experts layer (router, experts, balance loss), for --experts
    training.py  the optimizer, the learning-rate schedule, checkpoint files
    meter.py     the measuring instrument, attached from outside the technique
    mesh_traffic.py  the Meter's traffic split by DeviceMesh dimension (nd_parallel.py)
    report.py    progress, loss lines, measured-next-to-formula and the RESULT line

Scripts write `common.build_model(args)`: every name below is re-exported here. Process groups,
samplers, wrapping, sharding, schedules and collectives are NOT here: each script writes its
technique and its skeleton out in full.
"""

import warnings

from common.data import (  # noqa: F401
    MNIST_MEAN,
    MNIST_STD,
    SYNTHETIC_SEED,
    SYNTHETIC_TEST,
    SYNTHETIC_TRAIN,
    TEST_BATCH,
    Digits,
    PaddedShards,
    _Masked,
    load_data,
    synthetic_digits,
    test_loader,
)
from common.launch import (  # noqa: F401
    Parser,
    free_port,
    get_parser,
    init_process_group,
    launch,
    parse_args,
    pick_backend,
    uses_gpus,
    world_size,
)
from common.mesh_traffic import traffic_per_mesh_dimension  # noqa: F401
from common.messages import (  # noqa: F401
    check,
    env_rank,
    fail,
    log,
)
from common.meter import (  # noqa: F401
    COLLECTIVES,
    CollectiveCounter,
    Meter,
    SavedActivations,
    memory,
    record_expert_load,
    record_pipeline_order,
    storage_bytes,
    untimed,
)
from common.model import (  # noqa: F401
    CLASSES,
    IMAGE,
    MLP,
    Attention,
    Block,
    Head,
    PatchEmbed,
    ViT,
    build_model,
    saved_outside_blocks,
)
from common.report import (  # noqa: F401
    Progress,
    fmt_bytes,
    log_loss,
    pipeline_timeline,
    progress,
    report,
    result,
    show_expert_load,
)
from common.training import (  # noqa: F401
    load_state_dict_file,
    make_optimizer,
    make_scheduler,
    save_checkpoint,
    total_steps,
)

# The one place that knows which torch this is. torch 2.14 renamed all_gather_into_tensor and
# reduce_scatter_tensor to *_single and warns on the old names; 2.11 has only the old ones. The
# scripts use the old names, which every supported torch has, and this silences the rename notice.
warnings.filterwarnings(
    "ignore", message=r".*is deprecated\. Please use `torch\.distributed\.\w+_single`"
)
