"""Direct check of a FlashMLA build: its sparse FP8 decode against a plain fp32 reference (no
mlacheck), so a broken build is told apart from an adapter problem.

    PYTHONPATH=SITE python3 docs/flashmla-build/smoke.py
"""

import time

import flash_mla
import torch

E4M3_MAX = 448.0


def v32_cache(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[pages, page, 576] fp32 -> (656-byte V3.2 cache as uint8, its dequantised fp32 values),
    quantised as FlashMLA's tests/quant.py does (per token x 128-channel power-of-two scales)."""
    pages, page, _ = k.shape
    nope = k[..., :512].reshape(pages, page, 4, 128)
    scale = torch.pow(2, (nope.abs().amax(-1).clamp_min(1e-4) / E4M3_MAX).log2().ceil())
    q8 = (nope / scale[..., None]).to(torch.float8_e4m3fn)
    rope = k[..., 512:].to(torch.bfloat16)
    cache = torch.empty(pages, page, 656, dtype=torch.uint8, device=k.device)
    cache[..., :512] = q8.reshape(pages, page, 512).view(torch.uint8)
    cache[..., 512:528] = scale.float().contiguous().view(torch.uint8).view(pages, page, 16)
    cache[..., 528:] = rope.contiguous().view(torch.uint8).view(pages, page, 128)
    deq = torch.cat([(q8.float() * scale[..., None]).reshape(pages, page, 512), rope.float()], -1)
    return cache, deq


def main() -> None:
    torch.manual_seed(0)
    b, s_q, topk, page, pages = 2, 2, 128, 64, 16
    for h in (64, 128):
        cache, deq = v32_cache(torch.randn(pages, page, 576, device="cuda") * 0.5)
        flat = deq.view(-1, 576)
        idx = torch.randint(0, pages * page, (b, s_q, topk), device="cuda", dtype=torch.int32)
        idx[0, 0, 100:] = -1
        q = torch.randn(b, s_q, h, 576, device="cuda").to(torch.bfloat16)
        sm = 576 ** -0.5
        sched, _ = flash_mla.get_mla_metadata()
        t = time.time()
        out, lse = flash_mla.flash_mla_with_kvcache(
            q=q, k_cache=cache.view(torch.float8_e4m3fn).view(pages, page, 1, 656),
            block_table=None, cache_seqlens=None, head_dim_v=512, tile_scheduler_metadata=sched,
            softmax_scale=sm, causal=False, is_fp8_kvcache=True, indices=idx)
        torch.cuda.synchronize()
        kk = flat[idx.clamp_min(0).long()]  # [b, s_q, topk, 576]
        s = torch.einsum("bshd,bstd->bsht", q.float(), kk) * sm
        s = s.masked_fill((idx < 0)[:, :, None, :], float("-inf"))
        ref = torch.einsum("bsht,bstd->bshd", torch.softmax(s, -1), kk[..., :512])
        err = (out.float() - ref).abs().max().item()
        lse_err = (lse - torch.logsumexp(s, -1).transpose(1, 2)).abs().max().item()
        print(f"h{h}: out {tuple(out.shape)} lse {tuple(lse.shape)} max|out-ref| {err:.4g} "
              f"max|lse-ref| {lse_err:.4g} (|ref| up to {ref.abs().max().item():.3g}), "
              f"{time.time() - t:.2f} s")
        assert err < 0.05 and lse_err < 1e-3, (err, lse_err)
    print("flashmla sparse smoke OK", flash_mla.__version__)


if __name__ == "__main__":
    main()
