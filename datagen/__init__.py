"""datagen: turn a GPU training box into a generation farm and back (Prefect-free core library)."""

__version__ = "0.1.0"
