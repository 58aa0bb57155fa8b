"""Row-wise quantization in fbgemm's layout, and the rules of what the quantized kernel holds.

An INT8/INT4/INT2 row is `dim * bits / 8` bytes of codes plus a 4-byte scale/bias
(two fp16). Codes are packed low bits first: INT4 element `2i` is the low nibble of byte
`i`, INT2 element `4i + k` sits at bits `2k`. Per row:

    bias  = fp16(min(row))
    scale = fp16((max(row) - bias) / (2**bits - 1))      (1 if that is 0 or too small)
    code  = clamp(round((x - bias) / scale), 0, 2**bits - 1)
    x    ~= code * scale + bias

These are fbgemm's own formulas (`FloatOrHalfToFusedNBitRowwiseQuantizedSBHalf`,
bit for bit, which tests check), written in torch so that they run on any device and any
dim the kernel can hold (fbgemm's op also wants an even number of bytes per row). So a
value is off by at most `scale / 2` (plus fp16 rounding of the bias); FP16 rows are off by
at most `|x| * 2**-11`.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch

from recshard.modules.embedding_configs import DataType

# What `quantize_embeddings` and the quantized modules accept, TorchRec's names first.
TORCH_DTYPE_TO_DATA_TYPE: Dict[torch.dtype, DataType] = {  # TorchRec's dtype_to_data_type
    torch.qint8: DataType.INT8,
    torch.quint8: DataType.INT8,
    torch.int8: DataType.INT8,  # TorchRec's quantization tutorial asks for torch.int8
    torch.quint4x2: DataType.INT4,
    torch.quint2x4: DataType.INT2,
    torch.float16: DataType.FP16,
    torch.float32: DataType.FP32,
}
QUANT_DATA_TYPES = (DataType.INT8, DataType.INT4, DataType.INT2, DataType.FP16, DataType.FP32)
BITS = {DataType.INT8: 8, DataType.INT4: 4, DataType.INT2: 2}
SCALE_BIAS_BYTES = 4  # fp16 scale, fp16 bias, at the start of each row
ROW_ALIGNMENT = 16  # bytes per row in TorchRec's quantized state dict (fbgemm's default)
FP16_MAX = 65504.0

DtypeLike = torch.dtype | DataType | str


def _choices() -> str:
    return ", ".join(f"{d} ({t.value})" for d, t in TORCH_DTYPE_TO_DATA_TYPE.items())


def data_type_of(dtype: DtypeLike, table: str) -> DataType:
    """The storage type for a requested dtype (`torch.qint8`, `DataType.INT4`, "int4", ...)."""
    if isinstance(dtype, torch.dtype):
        data_type = TORCH_DTYPE_TO_DATA_TYPE.get(dtype)
    else:
        try:
            data_type = DataType(str(getattr(dtype, "value", dtype)).upper())
        except ValueError:
            data_type = None
    if data_type is None or data_type not in QUANT_DATA_TYPES:
        raise ValueError(
            f"table '{table}': the quantized embedding kernel cannot store {dtype} weights; "
            f"choose one of {_choices()}"
        )
    return data_type


def check_table_layout(table: str, dim: int, data_type: DataType) -> None:
    """Raise if fbgemm's quantized kernel cannot hold `dim` values of `data_type` per row."""
    if data_type not in QUANT_DATA_TYPES:
        raise ValueError(
            f"table '{table}': the quantized embedding kernel cannot store {data_type.value} "
            f"weights; choose one of {_choices()}"
        )
    per_byte = 8 // BITS.get(data_type, 8)
    if dim % per_byte:
        raise ValueError(
            f"table '{table}': embedding_dim {dim} cannot be stored as {data_type.value}: its "
            f"rows pack {per_byte} values per byte, so the dim must be a multiple of {per_byte} "
            f"(use INT8 or FP16 for this table)"
        )


def data_bytes(dim: int, data_type: DataType) -> int:
    """Bytes of a row's values (without scale/bias or padding)."""
    if data_type in BITS:
        return dim * BITS[data_type] // 8
    return dim * (2 if data_type == DataType.FP16 else 4)


def row_bytes(dim: int, data_type: DataType) -> int:
    """Bytes of a whole unpadded row: values plus, for integer types, scale/bias."""
    return data_bytes(dim, data_type) + (SCALE_BIAS_BYTES if data_type in BITS else 0)


def split_fused_rows(
    rows: torch.Tensor, dim: int, data_type: DataType
) -> Tuple[torch.Tensor, torch.Tensor] | None:
    """fbgemm's whole integer rows, as TorchRec's quantized modules keep them in their state
    dict (`uint8 [R, W]`: fp16 scale, fp16 bias, the codes, padding to `ROW_ALIGNMENT`
    bytes) -> (codes `uint8 [R, D * bits / 8]`, scale_bias `fp16 [R, 2]`); None for any
    other tensor."""
    width = row_bytes(dim, data_type)
    padded = -(-width // ROW_ALIGNMENT) * ROW_ALIGNMENT
    if data_type not in BITS or rows.dtype != torch.uint8 or rows.dim() != 2:
        return None
    if rows.size(1) != padded:
        return None
    scale_bias = rows[:, :SCALE_BIAS_BYTES].contiguous().view(torch.float16)
    return rows[:, SCALE_BIAS_BYTES:width], scale_bias


def quantize_rows(
    weight: torch.Tensor, data_type: DataType, table: str = "?"
) -> Tuple[torch.Tensor, torch.Tensor | None]:
    """Float rows `[R, D]` -> (values, scale_bias) in the kernel's layout.

    Integer types: values `uint8 [R, D * bits / 8]`, scale_bias `fp16 [R, 2]` (scale, bias).
    FP16/FP32: values `[R, D]` in that dtype, scale_bias None.
    """
    check_table_layout(table, weight.size(1), data_type)
    weight = weight.detach().float()
    if data_type == DataType.FP32:
        return weight.clone(), None
    if data_type == DataType.FP16:
        too_big = weight.abs() > FP16_MAX
        if bool(too_big.any()):
            raise ValueError(
                f"table '{table}': {int(too_big.sum())} weights exceed fp16's range "
                f"(max |w| = {weight.abs().max().item():.4g} > {FP16_MAX}); use INT8 or FP32"
            )
        return weight.half(), None
    bits = BITS[data_type]
    levels = (1 << bits) - 1
    bias = weight.min(dim=1).values.half()
    scale = ((weight.max(dim=1).values - bias.float()) / levels).half()
    inverse = 1.0 / scale.float()
    degenerate = (scale == 0) | torch.isinf(inverse)
    scale = torch.where(degenerate, torch.ones_like(scale), scale)
    inverse = torch.where(degenerate, torch.ones_like(inverse), inverse)
    codes = torch.round((weight - bias.float().unsqueeze(1)) * inverse.unsqueeze(1))
    codes = codes.clamp(0, levels).to(torch.uint8)
    return pack_codes(codes, bits), torch.stack([scale, bias], dim=1)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """`uint8 [R, D]` codes of `bits` each -> `uint8 [R, D * bits / 8]`, low bits first."""
    per_byte = 8 // bits
    if per_byte == 1:
        return codes.contiguous()
    grouped = codes.view(codes.size(0), -1, per_byte).to(torch.int32)
    shifts = torch.arange(per_byte, device=codes.device, dtype=torch.int32) * bits
    return (grouped << shifts).sum(dim=2).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Inverse of `pack_codes`: `uint8 [R, D * bits / 8]` -> `uint8 [R, D]`."""
    per_byte = 8 // bits
    if per_byte == 1:
        return packed[:, :dim]
    shifts = torch.arange(per_byte, device=packed.device, dtype=torch.int32) * bits
    codes = (packed.to(torch.int32).unsqueeze(2) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(packed.size(0), -1)[:, :dim].to(torch.uint8)


def dequantize_rows(
    values: torch.Tensor, scale_bias: torch.Tensor | None, data_type: DataType, dim: int
) -> torch.Tensor:
    """The float rows `[R, D]` the kernel reads from (values, scale_bias)."""
    if data_type not in BITS:
        return values.float()
    codes = unpack_codes(values, BITS[data_type], dim).float()
    scale_bias = scale_bias.float()
    return codes * scale_bias[:, :1] + scale_bias[:, 1:]


def max_row_error(
    values: torch.Tensor, scale_bias: torch.Tensor | None, data_type: DataType, dim: int
) -> torch.Tensor:
    """`[R]`: the most any value of each stored row can differ from the float it came from.

    INT: half a step (`scale / 2`), plus the fp16 rounding of the bias (`|bias| * 2**-11`:
    the row minimum may sit just below the stored bias and clamp to code 0), plus fp32
    rounding of the dequantization. FP16: `max |x| * 2**-11` plus the fp16 subnormal step.
    """
    rows = dequantize_rows(values, scale_bias, data_type, dim)
    if data_type == DataType.FP32:
        return torch.zeros(rows.size(0), device=rows.device)
    if data_type == DataType.FP16:
        return rows.abs().amax(dim=1) * 2.0**-11 + 2.0**-24
    scale, bias = scale_bias.float().unbind(dim=1)
    levels = (1 << BITS[data_type]) - 1
    return scale / 2 + bias.abs() * 2.0**-11 + (bias.abs() + levels * scale) * 2.0**-22 + 2.0**-24
