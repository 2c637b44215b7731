"""datagen: turn a GPU training box into a generation farm and back (Prefect-free core library)."""

import logging

__version__ = "0.1.0"

# A library's loggers stay quiet until the application configures logging (Python's last-resort handler
# would print warnings raw onto the terminal): the flow's Prefect logging, or the CLI's log file.
logging.getLogger(__name__).addHandler(logging.NullHandler())
