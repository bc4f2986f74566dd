"""The one refusal of the models package, raised by the loaders and the hub check alike."""


class ModelLoadError(RuntimeError):
    """A model could not be loaded or a pair is unusable; the message says which and why."""
