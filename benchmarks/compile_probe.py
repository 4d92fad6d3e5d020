"""Does torch.compile pay on the native backend? Times one decode step's MLP and pre-attention
blocks (30 layers, int4 weights of the default model, one row) eager against torch.compile'd,
and checks the compiled block is still row-invariant.

    python benchmarks/compile_probe.py
"""
import time, torch
import torch.nn.functional as F
torch.set_num_threads(2)
from specdec.models import load_model
m = load_model(); b = m.backend
L = b.layers
def mlp_block(x, norm_w, gu_w, gu_sz, down_w, down_sz):
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm_w
    gu = torch.ops.aten._weight_int4pack_mm_for_cpu(h.to(torch.bfloat16), gu_w, 32, gu_sz)
    gate, up = gu.chunk(2, dim=-1)
    return x + torch.ops.aten._weight_int4pack_mm_for_cpu(F.silu(gate) * up, down_w, 32, down_sz)
def pre_block(x, norm_w, qkv_w, qkv_sz, cos, sin):
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm_w
    qkv = torch.ops.aten._weight_int4pack_mm_for_cpu(h.to(torch.bfloat16), qkv_w, 32, qkv_sz).float()
    qkv = qkv.view(x.shape[0], 15, 64).transpose(0, 1)  # [heads, rows, hd]
    qk, v = qkv[:12], qkv[12:]
    half = 32
    rot = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
    qk = qk * cos + rot * sin
    return qk[:9].contiguous(), qk[9:].contiguous(), v.contiguous()
cmlp = torch.compile(mlp_block, dynamic=True)
cpre = torch.compile(pre_block, dynamic=True)
x = torch.randn(1, 576); cos = torch.randn(1, 64); sin = torch.randn(1, 64)
args = lambda l: (x, l.mlp_norm, l.gate_up.tensors["weight"], l.gate_up.tensors["scales_and_zeros"], l.down.tensors["weight"], l.down.tensors["scales_and_zeros"])
pargs = lambda l: (x, l.attn_norm, l.qkv.tensors["weight"], l.qkv.tensors["scales_and_zeros"], cos, sin)
t = time.perf_counter(); cmlp(*args(L[0])); cpre(*pargs(L[0])); print("compile s", time.perf_counter() - t)
def bench(f, reps=30):
    for _ in range(3): f()
    s = time.perf_counter()
    for _ in range(reps): f()
    return (time.perf_counter() - s) / reps * 1e3
for name, fm, fp in (("eager", mlp_block, pre_block), ("compiled", cmlp, cpre)):
    print(name, "mlp x30 %.2f ms" % bench(lambda: [fm(*args(l)) for l in L]), "pre x30 %.2f ms" % bench(lambda: [fp(*pargs(l)) for l in L]))
x5 = torch.randn(5, 576)
a = cmlp(x5, *args(L[0])[1:]); s = torch.cat([cmlp(x5[i:i+1], *args(L[0])[1:]) for i in range(5)])
print("compiled mlp row-invariant:", torch.equal(a, s), "eager==compiled:", torch.equal(mlp_block(x5, *args(L[0])[1:]), a))
