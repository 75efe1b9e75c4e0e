"""W&B (--wandb-project) on rank 0. Its credentials and mode are checked before the first
collective, where W&B can tell without the network (its own lookup: WANDB_API_KEY, its settings
files, .netrc); an init that fails later (a compute node without network) is one message, and
the run goes on without W&B or stops, as --wandb-init-failure says."""

from ..errors import ConfigError

EXTRA = "pip install 'megatron_ulysses[wandb]'"
FIXES = ("run `wandb login` once on this machine, set WANDB_API_KEY, or set WANDB_MODE=offline "
         "(the run is logged locally; `wandb sync` uploads it later)")
LOCAL_MODES = ("offline", "dryrun", "disabled")  # W&B modes that need no key


def check_credentials(project: str) -> None:
    """Rank 0, before the process groups: a `ConfigError` where W&B is online but finds no
    usable API key. An older wandb without this lookup is left to `start`."""
    import wandb

    settings = wandb.setup().settings
    if settings.mode in LOCAL_MODES:
        return
    try:
        from wandb.sdk.lib import wbauth
    except ImportError:
        return
    try:
        found = wbauth.authenticate_session(host=settings.base_url, source="--wandb-project",
                                            prompt=False, verify=False, update_session=False)
    except wandb.errors.Error as error:  # a key of the wrong format
        raise ConfigError(f"--wandb-project {project}: {error}. Fix it: {FIXES}") from None
    if found is None:
        raise ConfigError(
            f"--wandb-project {project}: W&B has no API key on this machine (none in "
            f"WANDB_API_KEY, W&B's settings or ~/.netrc for {settings.base_url}; WANDB_MODE "
            f"{settings.mode}). Fix it: {FIXES}")


def start(logging, run_config: dict):
    """Rank 0: the W&B run, or None where `wandb.init` failed and --wandb-init-failure is
    continue (a warning says so); with exit, a `ConfigError`."""
    import wandb

    try:
        return wandb.init(project=logging.wandb_project, entity=logging.wandb_entity,
                          name=logging.wandb_exp_name, dir=logging.wandb_save_dir,
                          config=run_config)
    except Exception as error:  # CommError, a timeout, a UsageError: W&B's reasons vary
        cause = (str(error).strip().splitlines() or [""])[0][:300]
        what = (f"--wandb-project {logging.wandb_project}: wandb.init failed "
                f"({type(error).__name__}: {cause})")
    if logging.wandb_init_failure == "exit":
        raise ConfigError(f"{what}. The run stops (--wandb-init-failure exit): WANDB_MODE=offline "
                          "logs locally, or --wandb-init-failure continue trains without W&B")
    print(f" WARNING: {what}. Training goes on without W&B (--wandb-init-failure continue; "
          "exit stops the run instead)", flush=True)
    return None
