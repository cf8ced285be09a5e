"""torchtitan's Trainer: its recording (recording.py), its model read under Hugging Face names (view.py) and its
configs mapped onto transformers' (config.py)."""

from parity.frameworks import Framework


def _install() -> None:
    from parity.frameworks.torchtitan import recording

    recording.install()


def _command_refusal(command: list[str]) -> str | None:
    from parity.frameworks.torchtitan.recording import command_refusal

    return command_refusal(command)


FRAMEWORK = Framework("torchtitan", "torchtitan's Trainer", "torchtitan", "0.3.0", install=_install,
                      command_refusal=_command_refusal)
