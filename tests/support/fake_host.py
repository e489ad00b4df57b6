"""The fake backend's model changes, as engine/host.py and engine/governor.py make them on the
engine thread: a load (the old model dropped first, a failure bringing the previous one back), the
context capped at the trained length, and a reconfigure that never reloads the model."""
from dataclasses import replace

from kvchat.core.commands import LoadModel, Reconfigure, refuse
from kvchat.core.config import ConfigError, EngineConfig, Precision
from kvchat.core.errors import first_line
from kvchat.core.events import EngineError, LoadFailed, ModelReady, Reconfigured, Refused
from kvchat.core.model_source import ModelError

from support.fake_loading import load as load_files
from support.fake_model import layout, snapshot


def load(fake, command: LoadModel) -> None:
    if fake.loads.superseded(command.seq):
        return refuse(command, "replaced by a later model choice")
    fake.ready.clear()
    try:
        fake.model, fake.handle = None, None
        fake.cache.clear()
        try:
            start(fake, command.config, command.seq)
        except (ModelError, ConfigError, EngineError) as error:
            return failed(fake, command, str(error))
        fake.good, fake.load_error = fake.config, None
        settings = fake.settings()
        command.future.set_result(settings)
        fake.announce(ModelReady(fake.model.label, settings, fake.model.config, dict(fake.model.generation)))
    finally:
        if fake.loads.ended(command.seq):
            fake.ready.set()


def failed(fake, command: LoadModel, reason: str) -> None:
    fake.model = None
    if fake.loads.superseded(command.seq):
        return refuse(command, "replaced by a later model choice")
    restored = False
    if fake.good is not None:
        try:
            start(fake, fake.good, None)
            restored = True
        except (ModelError, ConfigError, EngineError) as error:
            fake.model, fake.good = None, None
            fake.notice("load", f"the previous model could not be loaded again: {error}")
    message = reason + ("; the previous model is back" if restored else "")
    fake.load_error = None if restored else reason
    command.future.set_exception(EngineError(message))
    fake.announce(LoadFailed(message, fake.settings() if restored else None))


def start(fake, config: EngineConfig, seq: int | None) -> None:
    fake.config = config
    model = load_files(fake, config.model, seq)
    if fake.loads.stop_reason(seq):
        raise ModelError(fake.loads.stop_reason(seq))
    fake.model = model
    # as the engine's load says what "auto" chose: int8 on the CPU, where the decode step compiles
    model.config.kvchat_weights = {"auto": "int8", "none": "float32"}.get(config.weights, config.weights)
    fake.config = config = capped(fake, config)
    fake.precision = layout(model, config)


def capped(fake, config: EngineConfig) -> EngineConfig:
    trained = fake.model.trained
    if not trained or config.max_context <= trained:
        return config
    if config.allow_long_context:
        fake.notice("context", f"{config.max_context:,} tokens is longer than the {trained:,} the model was "
                               "trained for: expect worse answers past that")
        return config
    fake.notice("context", f"{config.max_context:,} tokens capped at {trained:,}, the length the model "
                           "was trained for")
    return replace(config, max_context=trained)



def reconfigure(fake, command: Reconfigure) -> None:
    old = fake.config
    try:
        new = replace(old, max_context=command.max_context or old.max_context,
                      kv_precision=command.kv_precision or old.kv_precision,
                      headroom_bytes=old.headroom_bytes if command.headroom_bytes is None else command.headroom_bytes)
        new = capped(fake, new)
        precision = layout(fake.model, new)
    except (ConfigError, ValueError) as error:
        return command.future.set_exception(ConfigError(first_line(error)))
    except Refused as error:
        fake.notice("rebuild", f"settings not applied: {error}")
        return command.future.set_exception(error)
    if [*Precision].index(precision) < [*Precision].index(fake.precision):
        fake.cache.clear()  # lossy blocks must not pass for full-precision ones
    fake.config, fake.precision = new, precision
    settings = {**fake.settings(), "kv_budget": snapshot(fake.model, new, precision, 0, 0).kv_total}
    command.future.set_result(settings)
    fake.emit(Reconfigured(settings))
