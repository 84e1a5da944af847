"""Issue 23, step 1: SGLang's CPU engine at ``--tp-size 2`` gives the greedy tokens of TP 1.

The server is plain SGLang of the patched venv (no ``--pdd-role``) at TP 2: patch 0017 keeps the
CPU engine's model-parallel groups off PyNccl, so its two ranks all-reduce through
``torch.distributed`` over gloo, and ``SGLANG_CPU_OMP_THREADS_BIND=0|1`` gives each rank a core
(``pdd_sglang.dev.testing.mixed_tp``: ``CPU_TP2_ENV``). The reference is the session's plain TP 1
server of the pristine wheel. Float32 sums of two partial products in another order than one
matmul's move the logits in their last bits (measured: at most 1.4e-6 in a sampled token's
logprob), so the test compares greedy tokens, on a batch of concurrent prompts (several batch
shapes) and on a repeat of one prompt (the radix-cache hit path).

Issue 37 (after issue 23's one TP size everywhere): PDD's prefill, relay and main each at its own
TP size, here ``conftest.MAKE_TEST_TP`` (P1/R1/M2: one prefill rank writes each of main's two
ranks its own KV heads, and a TP 1 relay hands off to a TP 2 main), token for token against the
plain TP 2 server, on the module's one TP cluster (``conftest.py``: ``tp_cluster``), with the
checks of :func:`pdd_sglang.dev.testing.mixed_tp.check_combination`: through the PDD router a
P->MD request, a P->RLD->MD request handed off and one the relay finishes alone; a forced
One-Shot and a forced Catch-Up; the Catch-Up conversation's next turn, where prefill sends main
only the suffix its radix cache lacks (WAN bytes summed over prefill's ranks and main's sessions
against the ideal); the KV digest verifying every handed-off copy (main's ranks' heads combined);
every rank of every role back to its baseline pool and zero radix locks. Then SIGTERM closes PDD
on every rank of every role. ``scripts/tp_matrix.py`` runs every other combination of TP 1 and 2.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

from pdd_sglang.dev.testing.mixed_tp import check_combination, stop_and_check_shutdown

GREEDY = {"max_new_tokens": 48, "temperature": 0, "ignore_eos": True}
PROMPT_SEED = 23
LENGTHS = (5, 17, 60, 130, 300, 700, 9, 250)


def prompts() -> list[list[int]]:
    rng = random.Random(PROMPT_SEED)
    return [[rng.randrange(10, 1000) for _ in range(n)] for n in LENGTHS]


def test_sglang_cpu_engine_at_tp_2_matches_tp_1_greedy(page16_cluster, tp_cluster):
    reference = page16_cluster["plain"]
    tp2 = tp_cluster["plain_tp2"]
    info = tp2.get_json("/server_info")
    assert info["tp_size"] == 2 and "pdd" not in info["internal_states"][0]

    def both(prompt):
        body = {"input_ids": prompt, "sampling_params": GREEDY}
        return (tp2.post_json("/generate", body)["output_ids"],
                reference.post_json("/generate", body)["output_ids"])

    batch = prompts()
    with ThreadPoolExecutor(len(batch)) as pool:  # concurrent: batched on both servers
        answers = list(pool.map(both, batch))
    answers.append(both(batch[4]))  # a repeat: its prompt hits the TP 2 radix cache
    differing = [(len(p), i) for p, (got, want), i in
                 zip(batch + [batch[4]], answers, range(len(answers))) if got != want]
    assert differing == [], f"(prompt length, index) where TP 2 differs from TP 1: {differing}"
    assert all(len(got) == GREEDY["max_new_tokens"] for got, _ in answers)
    assert tp_cluster.dead_servers() == []


def test_pdd_at_mixed_tp_sizes_matches_plain_sglang(tp_cluster, tiny_model):
    seen = check_combination(tp_cluster, tiny_model[0].kv_bytes_per_token,
                             tp_cluster["plain_tp2"])
    print(f"{tp_cluster.sizes.label}:", seen)
    stop_and_check_shutdown(tp_cluster)
