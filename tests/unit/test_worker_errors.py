"""A data error raised in a DataLoader worker reaches the user as the one message it was raised
with, not behind torch's "Caught ... in DataLoader worker process 0. Original Traceback"."""

from torch._utils import ExceptionWrapper

from megatron_ulysses.data.datasets import DataError
from megatron_ulysses.errors import ConfigError
from megatron_ulysses.training.cli import worker_error


def _as_from_a_worker(error):
    try:
        raise error
    except type(error):
        wrapper = ExceptionWrapper(where="in DataLoader worker process 0")
    try:
        wrapper.reraise()
    except type(error) as reraised:
        return reraised


def test_a_worker_error_is_its_own_message():
    message = "--data-path chat.jsonl line 3: conversation 1 is not a list of messages"
    for kind in (DataError, ConfigError):
        wrapped = _as_from_a_worker(kind(message))
        assert str(wrapped).startswith("Caught ") and "Traceback" in str(wrapped)
        unwrapped = worker_error(wrapped)
        assert type(unwrapped) is kind and str(unwrapped) == message


def test_an_error_of_the_main_process_is_kept():
    error = DataError("Caught fish: a message that only starts like torch's")
    assert worker_error(error) is error
