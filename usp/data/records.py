"""Documents from record files (jsonl, parquet, arrow), read by HF `datasets` from the local file
only: streaming (a batch of records at a time: bounded memory, no Arrow cache written under
~/.cache/huggingface), offline (HF_DATASETS_OFFLINE: the packaged json/parquet/arrow builders
need no hub). `datasets` is imported here only, when such a file is read (an optional extra:
`pip install 'usp[hf]'`)."""
from __future__ import annotations

import os
from collections.abc import Iterator

from usp.data.data_error import DataError

BATCH_RECORDS = 1000


def iter_records(path: str, builder: str, text_field: str) -> Iterator[str]:
    """The text_field of every record of one file, in file order."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # before the import: datasets reads it once
    try:
        import datasets
    except ImportError:
        raise DataError(f"data.paths: {path} is a {builder} file, read with HF datasets, which is not installed:"
                        " pip install datasets (or 'usp[hf]')") from None
    datasets.disable_progress_bars()
    try:
        stream = datasets.load_dataset(builder, data_files=[path], split="train", streaming=True)
        columns = stream.column_names
        if columns is not None and text_field not in columns:
            raise DataError(f"data.text_field={text_field!r} is not a column of {path}; its columns: {columns}")
        for batch in stream.select_columns([text_field]).iter(batch_size=BATCH_RECORDS):
            for text in batch[text_field]:
                yield text if isinstance(text, str) else ("" if text is None else str(text))
    except DataError:
        raise
    except KeyError as exc:  # a json file whose later records lack the field
        raise DataError(f"data.text_field={text_field!r}: a record of {path} has no such field ({exc})") from None
    except Exception as exc:  # pyarrow / datasets raise many types for a damaged file
        raise DataError(f"data.paths: {path} can't be read as {builder}: {type(exc).__name__}: {exc}") from None
