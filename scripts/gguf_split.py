"""Split a GGUF file into parts the way llama.cpp's ``llama-gguf-split --split`` does.

    python -m scripts.gguf_split MODEL.gguf OUT_PREFIX --parts 3
    # -> OUT_PREFIX-00001-of-00003.gguf ... (the metadata in the first part; every part
    #    carries split.no, split.count and split.tensors.count)

For the tests and benchmarks of split models (Hugging Face publishes large GGUFs this
way) where llama.cpp's tool is not at hand. Tensors are copied from the source's mapping
part by part (gguf's writer), never all held in memory; the parts hold the tensors in the
source's order, as evenly as whole tensors allow by bytes.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from gguf import GGUFReader, GGUFValueType, GGUFWriter
from gguf.constants import Keys
from gguf.gguf_writer import GGUFValue

# The reader's own fields (the header's counts) and the split keys the writer sets.
_NOT_COPIED = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", Keys.General.ARCHITECTURE}
_NOT_COPIED |= {Keys.Split.LLM_KV_SPLIT_NO, Keys.Split.LLM_KV_SPLIT_COUNT}
_NOT_COPIED |= {Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT}


def split_gguf(source: Path, prefix: Path, parts: int) -> list[Path]:
    """Write ``source`` as ``parts`` files named ``{prefix}-0000i-of-0000N.gguf``; return
    their paths in order."""
    reader = GGUFReader(source)
    if not 2 <= parts <= len(reader.tensors):
        raise ValueError(f"{source} has {len(reader.tensors)} tensors: cannot make {parts} parts")
    arch = reader.fields[Keys.General.ARCHITECTURE].contents()
    total = sum(int(t.n_bytes) for t in reader.tensors)
    # Cut before the tensor that would take a part past its share of the bytes (and keep
    # enough tensors for the parts after it).
    per_part = max(1, -(-total // parts))
    cuts: list[int] = []
    done = 0
    for index, tensor in enumerate(reader.tensors):
        left = len(reader.tensors) - index
        if (
            len(cuts) < parts - 1
            and index > 0
            and (
                done + int(tensor.n_bytes) > per_part * (len(cuts) + 1)
                or left == parts - 1 - len(cuts)
            )
        ):
            cuts.append(index)
        done += int(tensor.n_bytes)
    writer = GGUFWriter(prefix.with_name(prefix.name + ".gguf"), arch)
    for key, field in reader.fields.items():
        if key in _NOT_COPIED:
            continue
        if key == Keys.General.ALIGNMENT:
            # The writer pads every part's data to it: every part's header must say so
            # (a reader takes each file's alignment from its own header, as llama.cpp does).
            alignment = int(field.contents())
            writer.add_custom_alignment(alignment)
            _align_every_part(writer, alignment)
            continue
        main = GGUFValueType(field.types[0])
        sub = GGUFValueType(field.types[-1]) if main == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), main, sub_type=sub)
    for index, tensor in enumerate(reader.tensors):
        if index in cuts:
            writer.tensors.append({})  # the next part starts here (the writer's own cut)
        writer.add_tensor_info(
            tensor.name,
            tensor.data.shape,
            tensor.data.dtype,
            int(tensor.n_bytes),
            tensor.tensor_type,
        )
    names = writer.format_shard_names(writer.path) if writer.path else []
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for tensor in reader.tensors:
        writer.write_tensor_data(tensor.data)
    writer.close()
    return [Path(n) for n in names]


def _align_every_part(writer: GGUFWriter, alignment: int) -> None:
    """The writer gives the later parts only the split keys: add the alignment to theirs
    once it has made them (its own step, wrapped)."""
    make_parts = writer.add_shard_kv_data

    def with_alignment() -> None:
        make_parts()
        for kv in writer.kv_data[1:]:
            kv[Keys.General.ALIGNMENT] = GGUFValue(alignment, GGUFValueType.UINT32)

    setattr(writer, "add_shard_kv_data", with_alignment)  # noqa: B010


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.gguf_split", description=__doc__)
    parser.add_argument("model", type=Path, help="the GGUF file to split")
    parser.add_argument("prefix", type=Path, help="the parts' path before -0000i-of-0000N.gguf")
    parser.add_argument("--parts", type=int, default=2, help="how many parts (default 2)")
    args = parser.parse_args(argv)
    try:
        written = split_gguf(args.model, args.prefix, args.parts)
    except (OSError, ValueError) as err:
        print(f"gguf_split: {err}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
