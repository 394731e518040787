"""Print the timing model's error against the measured profiles (protocol/timing.py's docstring quotes it).

.venv/bin/python -m engine_sim.timing_report
"""

from __future__ import annotations

from protocol.timing import DEFAULT_PROFILE, TimingModel, fit_marginal, load_profile, mixed_marginals, profile_names

__all__ = ["main"]


def main() -> None:
    for name in profile_names():
        tm, prof = TimingModel.for_profile(name), load_profile(name)
        worst_p = max(abs(tm.prefill(n, c) - s) / s for n, c, s in prof.prefill)
        worst_d = max(abs(tm.decode(b, x) - s) / s for b, x, s in prof.decode)
        print(f"{name}: max error at the table points: prefill {worst_p:.2%}, decode {worst_d:.2%}")
    fit = fit_marginal()
    a_us, b_ns, e_ns = fit.a * 1e6, fit.b * 1e9, fit.e * 1e9
    print(f"\nmixed-step marginal fit: a={a_us:.3f} us/token, b={b_ns:.4f} ns/token^2, e={e_ns:.3f} ns/(token*seq)")
    rows = mixed_marginals()
    errs = []
    head = ("batch", "ctx", "chunk", "cached", "measured ms", "model ms", "err ms", "err %")
    print(" ".join(f"{h:>{w}}" for h, w in zip(head, (5, 5, 5, 6, 11, 9, 7, 6), strict=True)))
    for b, ctx, n, c, m in rows:
        p = fit(n, c, b)
        errs.append((abs(p - m), abs(p - m) / m, n))
        print(
            f"{b:>5} {ctx:>5} {n:>5} {c:>6} {m * 1e3:>11.2f} {p * 1e3:>9.2f} {(p - m) * 1e3:>7.2f} {(p - m) / m:>6.1%}"
        )
    mae = sum(e[0] for e in errs) / len(errs)
    big = [e[1] for e in errs if e[2] >= 2048]
    print(
        f"\nmean absolute error {mae * 1e3:.2f} ms over {len(errs)} points; max {max(e[0] for e in errs) * 1e3:.2f} ms"
    )
    print(f"chunks of 2048 tokens: mean relative error {sum(big) / len(big):.1%}, max {max(big):.1%}")
    tm = TimingModel.for_profile(DEFAULT_PROFILE)
    print("\nexample: the stall a local prefill adds to running decodes (B=128, context 4096):")
    for n in (256, 1024, 2048):
        print(f"  +{n} tokens: model +{tm.marginal(n, 0, 128) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
