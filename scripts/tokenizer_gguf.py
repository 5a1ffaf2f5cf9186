"""Write a tokenizer-only copy of a GGUF: its metadata (the ``tokenizer.*`` keys and the rest) without tensors.

The tests' tiny checkpoints take the default model's tokenizer; a machine without the default model's package
(the GPU machine) gets this copy, a few MB, through ``POCKETLLM_TEST_TOKENIZER_GGUF``.
Usage: python scripts/tokenizer_gguf.py SOURCE.gguf OUT.gguf
"""

from __future__ import annotations

import sys

import gguf


def copy_metadata(source: str, out: str) -> None:
    reader = gguf.GGUFReader(source)
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(out, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_array(name, field.contents())
        else:
            writer.add_key_value(name, field.contents(), kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__.strip().splitlines()[-1])
    copy_metadata(sys.argv[1], sys.argv[2])
