#!/usr/bin/env bash
# The session's closing device calls (nvidia-h200-x2), in two parts to stay under 10 minutes each:
#   PART=a: every GPU test, then bench gather --quick, bench device --quick, bench store (device rows)
#   PART=b: the transfer-plan GPU tests again, bench device --quick, the full transfer and all-gather sweeps
#   PART=c: every GPU test, bench device --quick with the 8 GiB broadcast (traced), bench store (device
#           rows), and the transfer sweep's 80-layer points at 32/128/512 KiB (one call, ~6 minutes)
#   PART=f: every GPU test, bench device --quick with the 8 GiB broadcast (traced), bench store (device
#           rows), tools/trace_store_device.py, bench transfer at 32 layers x 16 KiB
#   PART=s5: every GPU test, tools/probe_store_load_host.py, tools/trace_store_device.py, bench transfer at 32 layers
#           x 16 KiB, bench device --quick (traced), bench store (device rows)
#   PART=s5b: device-object, client-device and store GPU tests; bench device (traced, profiled) with and without
#           the event thread's spin; worker round-trip probes and trace_store_device with spin/stage options
#   PART=s5f: every GPU test, bench device --quick --broadcast-gib 8, bench store (device rows), bench gather --quick
#   PART=s5t: the full bench transfer sweep
#   PART=s6a: session 6's first check: client/store GPU tests, tools/probe_request_ids.py, and bench store's device
#           rows with the session's starting code (ab_old/src, untracked) and the new code in turn (A/B/A/B)
#   PART=s6b: every GPU test, bench store's device rows A/B/A/B as in s6a, tools/trace_store_device.py, bench device
#           --quick
#   PART=s6f: session 6's closing call: every GPU test, bench store's device rows with the code before the 1 MiB
#           first stage (ab_prev/src, untracked) and the final code in turn (A/B/A/B), tools/trace_store_device.py,
#           bench device --quick --broadcast-gib 8, bench gather --quick, bench transfer at 32 layers x 16 KiB
#   PART=s6end: session 6's closing check: the client, reservation, store and device-object GPU tests, then
#           tools/probe_store_ab.py, bench store's device rows twice and tools/trace_store_device.py, final code
#   PART=s6z: session 6's last call: the client-device, reservation and client GPU tests, bench store's device rows
#           twice and tools/trace_store_device.py on the final code
#   PART=s6v: client-device and reservation GPU tests, bench store's device rows with the session's starting code
#           (ab_old/src) and the final code in turn (A/B/A/B), tools/trace_store_device.py
#   PART=s7a: session 7's first check: client-device, reservation and linger GPU tests, tools/probe_call_phases.py
#           with and without lingering hints, tools/probe_store_ab.py, tools/trace_store_device.py
#   PART=s7b: client-device, reservation, linger and landing GPU tests, tools/probe_store_ab.py (with the commit
#           ahead of the last copies and without), tools/probe_call_phases.py, tools/trace_store_device.py
#   PART=s7f: session 7's closing call: every GPU test, tools/probe_store_ab.py, bench store's device rows twice,
#           tools/trace_store_device.py, bench device --quick (2 GiB broadcast) with a waiting subscriber leading
#           its receive and without (KVSTRATA_DEVOBJ_LEAD=1/0)
#   PART=s7g: bench device --quick --broadcast-gib 8 (final code), the same with KVSTRATA_DEVOBJ_WORKER_SPIN_US=2000
#           (a knob of the session's, measured no faster and removed after this call),
#           tools/devobj_latency_cpu.py --ab, tools/probe_worker_phases.py, bench gather --quick
#   PART=s7z: session 7's last call, final code: every GPU test, tools/probe_store_ab.py, bench store's device rows
#           twice, tools/trace_store_device.py
#   PART=s8a: session 8's first look: tools/probe_gather_floor.py, bench device --quick traced (the 4 KiB hand-off's
#           steps), tools/devobj_latency_cpu.py --trace, tools/trace_store_device.py
#   PART=s8b: client-device, bench and device-object GPU tests; bench device --quick traced (isolated and
#           back-to-back hand-offs); tools/probe_store_ab.py; bench store's device rows twice; trace_store_device;
#           bench gather --quick
#   PART=s8c: client-device GPU tests; bench store's device rows with the session's starting code (ab_old/src,
#           untracked) and the new code in turn (A/B/A/B); tools/trace_store_device.py; tools/probe_store_ab.py;
#           bench device --quick traced
#   PART=s8d: client-device GPU tests; bench store's device rows A/B/A/B against ab_old/src (the session's start);
#           tools/trace_store_device.py; tools/probe_store_ab.py
#   PART=s8z: session 8's closing call: every GPU test, bench device --quick with the 8 GiB broadcast, bench store's
#           device rows twice, tools/trace_store_device.py, bench gather --quick, tools/probe_gather_floor.py
#   PART=s8e: bench device --quick (2 GiB broadcast) and tools/devobj_latency_cpu.py with the worker's device-object
#           request threads dozing for 5 ms after each request (KVSTRATA_DOZE_US=5000, a knob of the session's,
#           measured slower in the bench and removed after this call) and without, in turn
#   PART=s9a: as s8d, with ab_old/src the code before the placement table (session 9)
#   PART=s9b: tools/probe_placements.py; bench store's device rows with the new code, the new code with its worker's
#           placement table off (KVSTRATA_PLACEMENT_TABLE=0) and ab_old/src in turn, twice; trace_store_device --profile
#   PART=s9c: bench store's device rows with ab_old/src (before the placement table), ab_fewer/src (that code with
#           one request for every key left after the first stage's) and the new code in turn, twice; their traces
#   PART=s9d: client-device GPU tests; bench store's device rows with the new code (placement table on), the new
#           code with the table off (KVSTRATA_PLACEMENT_TABLE=0) and ab_old/src in turn, twice; trace_store_device
#   PART=s9z: session 9's closing call: every GPU test, bench store's device rows twice, trace_store_device,
#           tools/probe_placements.py
#   PART=s9e: client-device GPU tests; bench store's device rows and trace_store_device with the worker's placement
#           table on and off (KVSTRATA_PLACEMENT_TABLE=0) in turn, twice
#   PART=s10a: client-device GPU tests; bench store's device rows and trace_store_device with ab_old/src (the
#           session's start) and the new code in turn, twice
#   PART=s10b: client-device GPU tests; tools/probe_cold_ab.py twice; tools/trace_store_device.py
#   PART=s10z: session 10's closing call (nvidia-h200-x2): every GPU test, bench store's device rows twice,
#           tools/probe_cold_ab.py, tools/trace_store_device.py
#   PART=s10y: session 10's last call: the store, client-device, landing, reservation and bench GPU tests, bench
#           store's device rows twice, tools/probe_cold_ab.py, tools/probe_mset_tail.py
#   PART=s11a: session 11's first check (nvidia-h200-x2): the device-object GPU tests, tools/probe_handoff.py (direct
#           offers on and off, round by round) GPU0 -> GPU0 and GPU0 -> GPU1 traced, bench device --quick
#   PART=s11b: the device-object GPU tests, tools/probe_pause.py, tools/probe_handoff.py (offers after the request,
#           none, before it) GPU0 -> GPU0 and GPU0 -> GPU1 traced, the same GPU0 -> GPU1 with the leader pausing by
#           sched_yield (KVSTRATA_DEVOBJ_LEAD_PAUSE=yield, a knob of this call's code, removed after it), bench
#           device --quick
#   PART=s11c: tools/probe_handoff.py (offers after the request, none, before it) GPU0 -> GPU1 and GPU0 -> GPU0,
#           traced with the worker's steps
#   PART=s11d: tools/probe_cold_copy.py GPU0 -> GPU0 and GPU0 -> GPU1, tools/probe_pause.py
#   PART=s12y: session 12's last call (final code): the device-object GPU tests, tools/probe_handoff.py GPU0 -> GPU1
#           and GPU0 -> GPU0 (offers on and off, traced), bench device --quick --broadcast-gib 8
#   PART=s12z: session 12's closing call (nvidia-h200-x2): every GPU test, tools/probe_handoff.py GPU0 -> GPU1 and
#           GPU0 -> GPU0 (offers on and off), bench device --quick --broadcast-gib 8
#   PART=s12b: as s12a without bench device (offers' packing cache, the offered copy waited on its stream)
#   PART=s12a: session 12 (offers taken: the receive is done at its copy's end): the device-object GPU tests,
#           tools/probe_handoff.py GPU0 -> GPU1 and GPU0 -> GPU0 (offers on and off, traced), bench device --quick
#   PART=s11z: session 11's closing call (nvidia-h200-x2): every GPU test, tools/probe_handoff.py GPU0 -> GPU1 (offers
#           on and off), bench device --quick --broadcast-gib 8, bench store's device rows twice
#   PART=s11e: session 11's last call (the offered copy's owner checked before the match): the device-object GPU
#           tests, tools/probe_handoff.py GPU0 -> GPU1 and GPU0 -> GPU0 (offers on and off), bench device --quick
#   PART=s11f: session 11's last call (bench device measures the hand-off with offers and without, round by
#           round): the device-object GPU tests, bench device --quick --broadcast-gib 8
#   PART=s14a: session 14's first call (nvidia-h200-x2): every GPU test, tools/probe_handoff_floor.py GPU0 -> GPU1
#           and GPU0 -> GPU0, tools/probe_handoff.py GPU0 -> GPU1 traced, bench store's device rows twice
#   PART=s14b: tools/probe_handoff_steps.py (the hand-off's primitives alone)
#   PART=s14c: the host's idle states, then tools/probe_handoff_floor.py and tools/probe_handoff.py GPU0 -> GPU1
#           with and without a PM QoS request of 0 us held on /dev/cpu_dma_latency (no deep idle while held)
#   PART=s14d: tools/probe_async_calls.py (async device calls, 4 in flight: timeline), tools/trace_store_device.py
#   PART=s14e: client GPU tests, tools/probe_async_calls.py, bench store's device rows twice (async mget_h2d's
#           completion thread)
#   PART=s14f: client GPU tests, bench store's device rows with ab_old/src (the session's start) and the new code
#           in turn (A/B/A/B: async mget_h2d's issuing and completion threads), tools/probe_async_calls.py
#   PART=s14g: session 14's closing call (nvidia-h200-x2): every GPU test, bench store's device rows with
#           ab_old/src (the session's start) and the final code in turn (A/B/A/B), tools/probe_async_calls.py,
#           bench device --quick --broadcast-gib 8
#   PART=s14h: as s14f on the final code (async_mset_d2h back on its two pool threads)
#   PART=s14i: the client API's GPU tests (a new one: async mget_h2d calls in flight on CUDA tensors)
#   PART=s14j: bench store's device rows with ab_old/src (the session's start) and the final code in turn (A/B/A/B),
#           on nvidia-h200 (one GPU)
#   PART=s15a: session 15's first call (nvidia-h200-x2): every GPU test, tools/probe_worker_clients.py (small sets from
#           1-8 client processes) with the worker's default polling, polling for up to 8 clients (XSPIN_N=8) and none,
#           bench store's 4 KiB rows (1 and 8 clients, kvstrata alone) and device rows
#   PART=s15b: tools/probe_worker_clients.py with ab_old/src (the session's start) and the lane poller's code in turn
#           (A/B/A/B, 1-16 clients), bench store's device rows A/B/A/B the same way, bench device --quick
#   PART=s15c: tools/probe_worker_clients.py with ab_old/src (the session's start), ab_poll/src (the lane poller) and
#           the current code (the client waits longer for a polled lane's answer) in turn, twice, 1-24 clients
#   PART=s15d: tools/probe_worker_clients.py, the current code three times (its lane poller's spells and kicks shown),
#           then ab_poll/src (the poller's first commit) once, 1-24 clients
#   PART=s15e: session 15's closing call (nvidia-h200-x2): every GPU test, tools/probe_worker_clients.py (clients started
#           together) with ab_old/src (the session's start) and the final code in turn, twice, 1-24 clients, bench
#           store's 4 KiB rows (1 and 8 clients, kvstrata alone) and device rows
#   PART=s15f: bench device --quick on the final code (the 4 KiB hand-off beside the lane poller)
#   PART=s15g: tools/probe_worker_mixed.py (a socket request beside 8 writing clients) with ab_old/src (the session's
#           start), the final code, and the final code with a 0.5 ms GIL switch interval in the worker (XSW), twice
#   PART=s16a: session 16's first call (nvidia-h200-x2): every GPU test, tools/probe_worker_mixed.py --writers 8
#           with ab_poll/src (the first, yielding poller) and the final code in turn, twice; the same probe's new
#           --connect mode beside 0 and 1 writers; tools/probe_worker_clients.py 1-24 clients (final, ab_poll, final);
#           bench device --quick
#   PART=s17a: session 17's call (nvidia-h200-x2): every GPU test; with ab_old/src (session 16's code) and the
#           current code in turn: tools/probe_worker_mixed.py --connect beside 1 writer (twice each) and beside
#           none, --writers 8 (once each), tools/probe_worker_clients.py 1-24 clients (new, old, new); bench device
#           --quick
#   PART=s17b: session 17's second call (nvidia-h200-x2): tools/probe_worker_clients.py --tick, 1-24 clients, with the
#           current code, ab_nonap/src (the same without the client's naps in long lane waits) and ab_old/src
#           (session 16's code) in turn, three rounds
#   PART=s17c: session 17's last call (nvidia-h200-x2, final code): every GPU test, tools/probe_worker_mixed.py
#           --connect beside 1 writer (twice) and --writers 8; tools/probe_worker_clients.py --tick with the current
#           code and ab_old/src (session 16's) in turn, three rounds; bench device --quick
#   PART=s17d: session 17 (nvidia-h200-x2): tools/probe_worker_clients.py --clients 1,2,4 with ab_old/src (session
#           16's code), the current code and ab_mix/src (the current worker, session 16's client), in balanced orders
#   PART=s17e: session 17 (nvidia-h200-x2): tools/probe_worker_clients.py --clients 1, four rounds of ab_old/src
#           (session 16's), the current code and ab_ysched/src (the current code, sched_yield with the GIL held
#           between socket checks), order rotated
#   PART=s18a: session 18's first look (nvidia-h200, one GPU: DEVS=0,0; DEVS=0,1 on the pair): tools/probe_handoff_floor.py
#           and tools/probe_handoff.py --trace (where the isolated 4 KiB hand-off's time goes now), probe_handoff_steps,
#           bench store's device rows twice
#   PART=s18b: tools/probe_handoff.py --variants on,owarm,rhot,hot --trace (DEVS; the host's share of the isolated
#           hand-off: owner's core kept busy, reader still polling, both), tools/trace_store_device.py and bench
#           store's device rows, twice
#   PART=s18c: tools/probe_handoff.py --variants on,off (DEVS) with every busy-poll on (the defaults), the worker's
#           off (KVSTRATA_SPIN_US=0), the clients' off (device-object reply, lead and result spins 0), and all off
#   PART=s18z: session 18's closing call (final code): every GPU test, bench store's device rows twice,
#           tools/trace_store_device.py
#   PART=s18y: bench store's device rows with ab_old/src (session 17's code, d8cc224) and the final code in turn,
#           twice each (A/B/A/B), then tools/trace_store_device.py with each
#   PART=s18x: as s18y in the other order (new, ab_old, ab_old, new): bench store's device rows, then
#           tools/trace_store_device.py with each
#   PART=s18w: tools/probe_store_ops.py (the requests behind each bench-store device row, and its time) with
#           ab_old/src and the final code in turn, twice (call 7 ran a scratch copy that also printed the cache's size)
#   PART=s18v: tools/probe_handoff.py --variants on (DEVS) with ab_diag/src (the final code, its reader timing the
#           4 KiB copy call's wall and thread CPU time, untracked diagnostic), twice
#   PART=s18u: bench store's device rows with ab_old/src and the final code in ABBA order twice (8 runs)
#   PART=s18t: bench store's device rows with async_mset_d2h on two pool threads (as shipped) and on one
#           (KVSTRATA_ASYNC_MSET_THREADS=1, an experiment knob of this call's code, removed after it), 2 1 1 2 2 1 1 2
#   PART=s18s: tools/probe_async_calls.py (4 async calls in flight: where async_mset_d2h's time goes) twice,
#           tools/trace_store_device.py between
#   PART=s18r: tools/probe_async_calls.py --tail (async_mset_d2h threads' waits: lock, copies landing, requests),
#           twice
#   PART=s19a-s19f: session 19's calls with the push experiment (branch push-experiment, whose tools/gpu_final.sh
#           has them as run): a publisher copying a small object into the armed receive of a waiting subscriber,
#           against offers and the broker, round by round (tools/probe_handoff.py), and its GPU tests; s19c and s19d
#           ran that branch's tools/probe_push_copy.py, main's tools/probe_timeslice_copy.py less its variant on the
#           push's stream. Here s19c runs probe_timeslice_copy twice, s19d with --peer-busy (the peer process runs a
#           small kernel every 0.5 ms: the GPU time-slices two processes' contexts), without, and with again
#   PART=s19z: session 19's closing call (final code): tools/probe_timeslice_copy.py with and without --peer-busy,
#           tools/probe_handoff.py (offers on and off), every GPU test
#   PART=s19y: tools/probe_store_ops.py --before none / sleep / request, twice in turn (why the bench's "leases kept"
#           mget_h2d row reads below "another key written before each")
#   PART=s19x: with 131,072 validity slots (8,192 before): tools/probe_store_ops.py --before none and request, then
#           bench store's device rows
#   PART=s19w: session 19's last call (final code): every GPU test
#   PART=s20a: async_mset_d2h on the issuing and completion threads (a chain carving on in the reservation):
#           every GPU test, bench store's device rows with session 19's code (ab_old/src) and the new one in turn
#           (A/B/A/B), tools/probe_async_calls.py on the new code
#   PART=s20b: as s20a with a chain's refill at CHAIN_CALLS calls, without the GPU tests; probe_async_calls --tail
#   PART=s20c: as s20b with pipelined replies read under a lock of their own (sends go on meanwhile), the rows
#           A/B/B/A/A/B
#   PART=s20d: session 20's closing call (final code): every GPU test, bench store's device rows twice
#   PART=s20e: a reserved mset_d2h's stages after the first in one commit ahead of their copies: the client-device
#           GPU tests, bench store's device rows with 48d8175 (ab_mid/src) and the new code A/B/B/A/A/B,
#           tools/probe_async_calls.py --tail
#   PART=s20f: session 20's closing call (final code, 4b148d1): every GPU test, bench store's device rows twice
#   PART=s21a: the host cost of the calls that queue copies (tools/probe_copy_calls.py: cuda-bindings against
#           ctypes on libcudart), a device call's steps (tools/probe_first_copy.py), tools/trace_store_device.py
#   PART=s21b: (code 4804a1e) a reserved mset_d2h's commit ahead of its copies (one for the first 3 stages while the
#           rest are queued, one for the rest, no wait for the first stage's bytes): the client-device, landing and
#           reservation GPU tests, bench store's device rows with e8b3cf9 (ab_old/src) and the new code A/B/B/A/A/B,
#           tools/probe_first_copy.py with the commit while stages are queued off (--commit-ahead 0) and on
#   PART=s21c: (code 4804a1e, whose tools/probe_commit_ahead.py switches the commit while stages are queued off and on
#           call by call) that probe twice, bench store's device rows with e8b3cf9 (ab_old/src) and the new code
#           B/A/A/B
#   PART=s21d: session 21's closing call (final code, 6f2291e): every GPU test, bench store's device rows twice,
#           tools/probe_first_copy.py
#   PART=s21e: this process's pid kept current across fork() (no getpid per check), the worker's socket looked at once
#           per ms by cached reads, start()'s record and wait as raw runtime calls: the client-device, local-read,
#           reservation and landing GPU tests, tools/probe_first_copy.py with 6f2291e (ab_mid/src) and the new code
#           in turn, twice, bench store's device rows A/B/B/A/A/B
#   PART=s21f: session 21's closing call (final code, e2b96d1): every GPU test, bench store's device rows twice,
#           tools/probe_copy_calls.py, bench store's 4 KiB rows (1 client) with e8b3cf9 (ab_old/src) and the new code
#           A/B/B/A
#   PART=s21g: tools/probe_set_get.py (4 KiB set and cached get from one client) with e8b3cf9 (ab_old/src) and the
#           final code in turn, four times each; then bench store's 4 KiB rows (1 client) B/A
#   PART=s21h: bench store's 4 KiB rows (1 client, the GPU hidden: no device rows) with e8b3cf9 (ab_old/src) and the
#           final code in turn, A/B six times
#   PART=s21i: lscpu, tools/probe_smt.py (a busy Python loop on one CPU against a plain loop on each other CPU),
#           tools/probe_kept_after.py (a kept mget_h2d right after a request and after 2 ms quiet, call by call, the
#           client on any CPU and pinned to a few)
#   PART=s21j: bench store's device rows once, now with the client's CPU speed over the rounds (host_loop_us)
#   PART=s21k: session 21's last call (final code, 56c6c51): every GPU test
#   PART=s22a: session 22's one-pass kept mget_h2d: the client-device/kept-read GPU tests, bench store's device rows
#     with 11aa0aa (ab_old) and the new code A/B/B/A/A/B
#   PART=s22b: tools/probe_kept_split.py with 11aa0aa (ab_old) and the new code in turn, three times
#   PART=s22c: tools/probe_first_copy.py on the new code (the one-pass kept read's steps), twice
#   PART=s22d: tools/probe_first_batch.py (idle 1 ms and 0.1 ms), tools/probe_copy_calls.py
#   PART=s22e: one-pass reserved mset_d2h too: every GPU test, bench store's device rows A/B/B/A/A/B against 11aa0aa
#     (ab_old), tools/probe_kept_split.py A/B twice
#   PART=s22f: bench store's device rows, the new code and FIRST_RUNS=4 (ab_first4) in turn three times, /proc/stat's
#     per-CPU steal time before and after each run
#   PART=s22g: bench store's device rows with 2ea8098 (ab_mid: can_land looked at once) and the new code A/B/B/A/A/B
#   PART=s22h: one-pass placed (cold) reads and OnePass: every GPU test, bench store's device rows A/B/B/A/A/B against
#     the session's commit before them (ab_head), tools/probe_kept_split.py
#   PART=s22i: bench store's device rows, the session's commit before the placed reads (ab_head) and the new code in turn,
#     four times each
#   PART=s22j: one-pass placed reads, inline, the table looked up chunk by chunk: bench store's device rows against main's
#     code before them (ab_head), four times each, then every GPU test
#   PART=s23a: every GPU test; tools/probe_kept_split.py (kept, cold, mset) and bench store's device rows, the
#     kept pass's leases taken chunk by chunk (new) against main's code before (ab_head), A/B/B/A
#   PART=s23b: as s23a on a9a939d (mset_d2h's keys checked per batch too), A/B/B/A/A/B
#   PART=s23c: tools/probe_kept_ab.py three times (kept-lease lookup schedules switched call by call; the tool is in
#     commit 0d17281, removed with the schedules after this call)
#   PART=s23d: every GPU test; tools/probe_batch_growth.py three times (batch growths switched call by call);
#     bench store's device rows twice
#   PART=s23e: every GPU test; tools/probe_kept_tail.py twice (the wait for a kept read's copies, three ways call by
#     call); tools/probe_kept_split.py; bench store's device rows twice
#   PART=s23f: the session's closing call: every GPU test; bench store's device rows (new, ab_head, new);
#     tools/probe_kept_split.py
#   PART=s23g: the three copy-tracing probes once each, short, on their shared tools/_copy_trace.py
#   PART=s24a: every GPU test (bad arguments as kvstrata.InvalidArgument); bench store's device rows twice;
#     tools/probe_handoff.py GPU0 -> GPU0 (offers on)
#   PART=s24b: every GPU test; bench store's device rows with the worker's busy-polls as shipped and off
#     (KVSTRATA_SPIN_US=0), in the order default, off, off, default
#   PART=s24c: the session's closing call: every GPU test (collected with the docstrings' examples, which the
#     GPU mark deselects); the docstrings' examples on the GPU machine; bench store's device rows twice
#   PART=s24d: tools/probe_kept_after.py, tools/probe_store_ab.py and tools/trace_store_device.py on
#     tools/_copy_trace.kept_client (their worker and keys set up there now)
#   PART=s24e: tools/probe_kept_quiet.py twice (a kept read after a request, 2 ms asleep, 2 ms busy, 2 ms asleep
#     beside a DMA: the host's and the device's share of a quiet client's slower call)
#   PART=s25a: tools/probe_call_variants.py (then probe_legacy_join.py) three times (the copy stream joined to
#     the legacy stream by an event, or a blocking copy stream: kept mget_h2d and mset_d2h, call by call)
#   PART=s25b: tools/probe_call_variants.py twice with a third way (no join: what the join costs); bench store's
#     device rows with the blocking copy stream off, on, on, off (KVSTRATA_JOIN_LEGACY)
#   PART=s25c: tools/probe_call_variants.py twice with the idle check (the join skipped where the caller's stream has
#     nothing pending); every GPU test with it; bench store's device rows twice
#   PART=s25d: every GPU test (with the idle check's own); tools/probe_call_variants.py (join against the idle check);
#     bench store's device rows three times
#   PART=s25e: every GPU test (the idle check's test with 25 ms of pending work); tools/probe_call_variants.py
#     --holds twice (join, idle check, kept reads without their per-key holds); bench store's device rows twice
#   PART=s25f: the session's closing call: every GPU test; bench store's device rows twice;
#     tools/probe_call_variants.py --holds; tools/probe_handoff.py GPU0 -> GPU0 (offers on); the rows once more
#   PART=s26a: every GPU test; bench store's device rows with 2e30db2 (ab_old/src, session 25's end) and the new
#     code (kept reads pinned per call, not per key) A/B/B/A/A/B; tools/probe_kept_quiet.py with each in turn, twice
#   PART=s26b: tools/probe_call_steps.py (then probe_kept_steps.py: a kept read's steps before its first batch)
#     after a request and after 2 ms asleep, with ab_old/src (2e30db2) and the new code in turn, twice; bench store's device rows A/B/B/A
#   PART=s26c: as s26b, with the lease lookup's parts timed, the new code's import, check and worker-sighting cuts;
#     the rows A/B/B/A/A/B
#   PART=s26d: tools/probe_call_steps.py --op mset up to the third batch, after a request and after 2 ms asleep; the
#     same for a kept read
#   PART=s26e: the session's closing call: every GPU test; tools/probe_call_steps.py --op mset and --op kept up to the
#     third batch; bench store's device rows with ab_old/src (2e30db2) and the final code A/B/B/A/A/B
#   PART=s26f: every GPU test (the first mark after the third batch); tools/probe_call_steps.py --op mset and --op
#     kept up to the fourth batch; bench store's device rows with ab_old/src (2e30db2) and the final code A/B/B/A
#   PART=s26g: the session's last call: bench store's device rows twice on the final code, both JSONs kept
#   PART=s26h: bench store's device rows with ab_old/src (2e30db2) and the final code A/B/B/A/A/B
#   PART=s27a: tools/probe_copy_engines.py (new) three times; bench store's device rows twice on the session's start
#   PART=s27b: every GPU test; tools/probe_call_steps.py --op kept with ab_old/src (9747112) and the new code in turn,
#     twice each; bench store's device rows (ceilings before and after the rows) A/B/B/A/A/B against ab_old/src
#   PART=s27c: bench store's device rows B/A/A/B/B/A against ab_old/src (9747112), then once more on the final code
#   PART=s27d: bench store's device rows eight times on the final code
#   PART=s27e: tools/probe_batch_growth.py --first (a first batch of 2, 3 or 4 runs, switched call by call) four times
#   PART=s27f: every GPU test (a kept read's first batch of 3); tools/probe_batch_growth.py --first twice; bench store's
#     device rows A/B/B/A/A/B against ab_old/src (787704d: a first batch of 2)
#   PART=s27g: the session's last call: bench store's device rows six times on the final code
#   PART=s27h: every GPU test on the final code (the kept read's first enqueue with its own head)
#   PART=s27i: tools/probe_batch_growth.py --first with the cold read too (the placed read's first batch), twice
#   PART=s28a: the native copy planner built (kvstrata.ops.tensor_runs); every GPU test; tools/probe_batch_growth.py
#     --native (the kept read's planning native or in Python, call by call) twice; bench store's device rows
#     A/B/B/A/A/B against ab_old/src (9ad44c3: the session's start)
#   PART=s28b: bench store's device rows with the native planner off (nonative), on (new) and ab_old/src in turn,
#     three times
#   PART=s28c: tools/probe_native_planner.py (new: a kept read planned natively or in Python, call by call, 64 x 1 MiB,
#     256 x 256 KiB, 256 x 64 KiB) twice
#   PART=s28d: tools/probe_native_planner.py with the batch policies too (16 runs a batch at most, or 4x a cut's up to
#     64) twice
#   PART=s28e: the session's last call: every GPU test; tools/probe_native_planner.py; bench store's device rows with
#     the native planner off (nonative) and on (new) in turn, twice
#   PART=s28f: every GPU test (a reserved mset_d2h planned natively too); tools/probe_native_planner.py with the
#     write (new) twice; bench store's device rows with the native planner off (nonative) and on (new) in turn, twice
#   PART=s28g: the session's last call, final code: every GPU test; tools/probe_native_planner.py; bench store's
#     device rows with the native planner on, off (nonative), on
#   PART=s29a: kvstrata native (the driver's batch call found?); every GPU test; tools/probe_native_planner.py (native
#     passes queuing their own copies or not, call by call); bench store's device rows new/nocopies in turn, twice
#   PART=s29b: every GPU test (the placed read planned natively too); tools/probe_native_planner.py (with a cold read);
#     bench store's device rows new/ab_old/nocopies in turn, twice (ab_old/src: b11aeb0, the session's start)
#   PART=s29c: the session's last call, final code: every GPU test; tools/probe_native_planner.py twice; bench store's
#     device rows new/nocopies in turn
#   PART=s29d: every GPU test after the native passes moved to kvstrata.client.batching; tools/probe_native_planner.py;
#     bench store's device rows new/nocopies in turn, then new
#   PART=s29e: the session's last call, final code (the placement table read natively too): every GPU test;
#     tools/probe_native_planner.py (with "copies, py lookup") twice; bench store's device rows three times
#   PART=s29f: bench store's device rows four times on the final code (call 5 drew only slowed vCPUs)
#   PART=s30a: every GPU test (a kept read's cache lookup and the copy stream's join natively); tools/
#     probe_native_planner.py (those switched call by call) twice; bench store's device rows new/ab_old in turn, three
#     times (ab_old/src: 0fddc1e, the session's start)
#   PART=s30b: tools/probe_native_planner.py (session 29's code, the cache lookup native, the join too; rotated order)
#     twice; tools/probe_call_steps.py --op kept / mset; bench store's device rows three times
#   PART=s30c: every GPU test (native_copies found once per thread; a reservation for four calls);
#     tools/probe_call_steps.py --op kept / mset; tools/probe_native_planner.py (session 29's code against all native);
#     bench store's device rows new/ab_old in turn, twice
#   PART=s30d: the session's last call: tools/probe_native_planner.py (session 29's code against all native); bench
#     store's device rows new/ab_old/new/new in turn, twice
#   PART=s30e: the session's last call, final code (a reservation for two calls again): every GPU test; bench
#     store's device rows four times
#   PART=s30f: the GPU tests of the placed and device reads (a commit's placements published before its seal's
#     loop); bench store's device rows three times
#   PART=s31a: every GPU test (session 30's final code); tools/probe_call_steps.py --op mset twice (the write's steps
#           before its first pass wrapped too); bench store's device rows twice
#   PART=s31b: tools/probe_host_calls.py; tools/probe_call_steps.py --op mset with the session's starting code (ab_old/src,
#           untracked) and the new code (a write's key check after its first batch, a quicker reservation take) in
#           turn, twice; bench store's device rows likewise
#   PART=s31c: s31b again with the native module built first (s31b's tools timed the Python path, its bench rows
#           waited on a build lock a killed build left): tools/probe_host_calls.py; probe_call_steps --op mset and
#           bench store's device rows with ab_old/src and the new code in turn
#   PART=s31d: tools/probe_call_steps.py --op mset (the next reservation asked for while a write's last copies move);
#           bench store's device rows with ab_old/src and the new code in turn, three times
#   PART=s31e: the session's last call, final code: every GPU test; tools/probe_call_steps.py --op mset; bench store's
#           device rows four times
#   PART=s32a (run at 21209d5): every GPU test; tools/probe_native_planner.py (a kept read's first lookup of the
#           first batch's leases, the join folded into the first pass, both, neither: call by call) twice, around
#           bench store's device rows with ab_old/src (the session's start, untracked) and the new code in turn
#   PART=s32b (run at e431db5 with 69cd9f6's client change, before f463997): every GPU test;
#           tools/probe_native_planner.py (a write's commits while its later batches are queued, at 32, 64 and 128
#           keys a commit, against one commit once every copy is queued: call by call) twice; bench store's device
#           rows with ab_old/src and the new code in turn (A/B/A/B)
#   PART=s32c (run at 870a3ec): every GPU test; tools/probe_native_planner.py with ab_old/src (one commit once every
#           copy is queued, the worker's commit making every object) and the new code (its objects made when the
#           commit lands; commits while later batches are queued at 32, 64 and 128 keys, and none), twice in turn;
#           bench store's device rows A/B/A/B
#   PART=s32d (run at fedbe4a): every GPU test; tools/probe_native_planner.py with ab_old/src and the new code in
#           turn; bench store's device rows new/ab_old/new/ab_old/new
#   PART=s32e (run at db5cb0d): the client-device, placed-read, landing, kept-read and reservation GPU tests; bench
#           store's device rows new/ab_old/new (a landing commit's placements published before its objects are made)
#   PART=s33a: every GPU test; tools/probe_native_planner.py with ab_old/src (the session's start) and the new code (a
#           landing commit answered once its items are checked and its keys taken; its pieces cut after the answer)
#           in turn, twice; bench store's device rows A/B/A/B
#   PART=s33b (run at ede1e91): the client-device, placed-read, landing, kept-read, reservation and acquire GPU
#           tests; tools/probe_cold_phases.py (the lease request after 1 or 2 batches, call by call);
#           tools/probe_native_planner.py with ab_old/src (the session's start) and the new code in turn, twice;
#           bench store's device rows new/ab_old/new
#   PART=s33c (run at the session's final src): every GPU test; tools/probe_cold_phases.py; tools/probe_native_planner.py
#           with the new code and ab_old/src in turn; bench store's device rows new/ab_old/new/new
#   PART=s33d (run with ab_old/src = b9c1c67's, before the integer columns as bytes): every GPU test;
#           tools/probe_cold_phases.py; tools/probe_native_planner.py with the new code and ab_old/src in turn; bench
#           store's device rows new/ab_old/new
#   PART=s34a: session 34's check (the client's lifecycle fixes, write-back holds): every GPU test; bench store's
#     device rows three times; tools/probe_handoff.py GPU0 -> GPU0
#   PART=s35a: session 35's check (device-object fixes from an audit: delete waits for reads, fork, leaks): every
#     GPU test; bench store's device rows three times; tools/probe_handoff.py GPU0 -> GPU0
#   PART=s35b: every GPU test again (the broadcast leader's abort, NCCL pair resets); the hand-off probe
#   PART=s35c: the 4 KiB hand-off, session 34's src (base/src, from caaab09) against this session's, alternating
#   PART=s35d: every GPU test on the session's final src (the ops' and memory's argument checks)
#   PART=s36a: session 36's one call: every GPU test (large values retiring page-locked segments, close() waiting
#           for the worker's release, the transport/all-gather/device-object fixes), bench store's device rows twice,
#           the 4 KiB hand-off on one GPU, the time of one forced calibrate()
#   PART=s36b: every GPU test again on the session's final src (the large values' audit fixes, the review's)
#   PART=s37a: session 37's call: every GPU test (the audits' fixes: SSD faults, worker configuration, demo, bench
#           tools; the local-read cache's admission), bench store's device rows three times, the 4 KiB hand-off
#   PART=s38a: every GPU test; tools/probe_retired_pages.py with the session's starting code (ab_old/src, untracked)
#           and the new code; bench store's device rows; tools/probe_handoff.py (4 KiB hand-off, one GPU)
#   PART=s38b: every GPU test (the session's final code)
#   PART=s39: every GPU test; kvstrata bench prefix (PrefixKVCache against per-piece torch copies and DMA, a
#           2,048- and a 512-token request); kvstrata demo on the GPU
#   PART=s39b: the GPU tests of pack_blocks and PrefixKVCache; kvstrata bench prefix (packed and per piece) at
#           128 and 32 blocks; kvstrata demo on the GPU
#   PART=s39c: tools/probe_prefix_steps.py at 32 and 128 blocks; the GPU tests of pack_blocks and PrefixKVCache;
#           bench prefix at 128 blocks (its memory warmed first)
#   PART=s40: the GPU tests of session 40's work and session 39's left unrun (TCP device calls, checkpoints,
#     pack_blocks' custom ops under torch.compile, PrefixKVCache); kvstrata bench checkpoint (8 layers x 4096, bf16,
#     against torch.save/torch.load via /dev/shm and the DMA ceiling); kvstrata bench prefix --blocks 128.
#   PART=s41: every GPU test (session 40's work among them: TCP device calls, checkpoints, CUDA weights through a
#     cluster), kvstrata bench checkpoint and bench prefix --blocks 128 on the H200
#   PART=s41b: every GPU test (the attachments, the drain, etcd TLS code), then tools/probe_tcp_values.py with the
#     code before the attachments (ab_old/src, carried) and after, twice each, on the GPU host's CPUs
#   PART=s42: with etcd and etcd3gw carried (.etcdbin on PATH, .whl installed by the caller): every GPU test (the
#     etcd variants too), the cluster tests (rebalance), bench cluster twice with a 1 GiB join, on the host's 16 CPUs
#   PART=s42b: (etcd carried, as s42) kvstrata bench cluster's join row (1 GiB, short other rows) with the hand-off
#     before its pipelining and leases (ab_old/src, carried) and after, twice each
#   PART=s42c: (etcd carried, as s42) every GPU test and the cluster tests, on the session's last code
#   PART=s43: (etcd carried, as s42) every GPU test, the cluster tests, then tools/probe_tcp_values.py with the code
#     before the huge-page frame buffers and TCP get_buffers (ab_old/src, carried) and after, twice each
#   PART=m: every GPU test (stops at the first failure), bench device --quick (traced), bench store (device
#           rows), bench transfer at 32 layers x 16 KiB (with request latency, GEMM beside, store+load)
# JSON and one combined log land in $OUT (no PNGs: at most 8 files come back).
set -uo pipefail
export PYTHONPATH="$PWD/src" PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT="${OUT:-/tmp/kvstrata-out}"; mkdir -p "$OUT"
LOG="$OUT/part_${PART:-a}.log"
use() {  # use <variant>: run the current src (new), the current src with the native copy planner off (nonative) or
  # its passes' copies queued through cuda-bindings (nocopies), or <variant>/src (another version's) from here on
  unset KVSTRATA_NATIVE KVSTRATA_NATIVE_COPIES
  case $1 in
    new) export PYTHONPATH="$PWD/src" ;;
    nonative) export PYTHONPATH="$PWD/src" KVSTRATA_NATIVE=0 ;;
    nocopies) export PYTHONPATH="$PWD/src" KVSTRATA_NATIVE_COPIES=0 ;;
    *) export PYTHONPATH="$PWD/$1/src" ;;
  esac
}
gpu_tests() {  # gpu_tests <name>: every GPU test, the log in $OUT/<name>.log, its last lines in the combined log
  KVSTRATA_TEST_WAIT=20 timeout 300 python3 -m pytest -q -m "gpu or multigpu" -p no:cacheprovider --timeout 120 \
    > "$OUT/$1.log" 2>&1
  tail -3 "$OUT/$1.log" | tee -a "$LOG"
}
tick_rounds() {  # tick_rounds <rounds> <variant>...: tools/probe_worker_clients.py --tick per variant, round by round
  local rounds=$1 r v; shift
  for r in $(seq "$rounds"); do
    for v in "$@"; do
      use "$v"
      echo "=== tools/probe_worker_clients.py --tick ($v code, round $r)" >> "$LOG"
      timeout 90 python3 tools/probe_worker_clients.py --clients 1,2,4,8,24 --tick >> "$LOG" 2>&1
    done
  done
  use new
}
bench() {  # bench <seconds> <job> [args...]
  local limit=$1; shift
  echo "=== kvstrata bench $* ($(date -u +%FT%TZ))" | tee -a "$LOG"
  timeout "$limit" python3 -m kvstrata.cli.main bench "$@" --out "$OUT" >> "$LOG" 2>&1
  echo "rc=$?" >> "$LOG"
  rm -f "$OUT"/*.png
}
store_rows() {  # store_rows <variant>...: bench store's device rows with each variant's code (see use), in order
  local v
  for v in "$@"; do
    use "$v"
    echo "=== ($v code)" >> "$LOG"; bench 60 store --no-redis --no-mooncake --sizes 1MiB --clients 1
  done
  use new
}
tool_runs() {  # tool_runs <runs> <tool> [args...]: tools/<tool>.py <runs> times, each run's output under a header
  local runs=$1 tool=$2 r; shift 2
  for r in $(seq "$runs"); do
    echo "=== tools/${tool}.py $* (run $r)" >> "$LOG"
    timeout 150 python3 "tools/${tool}.py" "$@" >> "$LOG" 2>&1
  done
}
store_traces() {  # store_traces <variant>...: tools/trace_store_device.py with each variant's code, in order
  local v
  for v in "$@"; do
    use "$v"; echo "=== tools/trace_store_device.py ($v code)" >> "$LOG"
    timeout 60 python3 tools/trace_store_device.py >> "$LOG" 2>&1
  done
  use new
}
store_ab() {  # store_ab <dir>: bench store's device rows with <dir>/src and the current src in turn, twice each
  store_rows "$1" new "$1" new
}
table_ab() {  # table_ab <variant>...: bench store's device rows per variant in turn: new (the placement table on),
  # off (the same code, KVSTRATA_PLACEMENT_TABLE=0), or a folder holding another version's src
  local v
  for v in "$@"; do
    case $v in
      new) export PYTHONPATH="$PWD/src"; unset KVSTRATA_PLACEMENT_TABLE ;;
      off) export PYTHONPATH="$PWD/src" KVSTRATA_PLACEMENT_TABLE=0 ;;
      *) export PYTHONPATH="$PWD/$v/src"; unset KVSTRATA_PLACEMENT_TABLE ;;
    esac
    echo "=== ($v code)" >> "$LOG"; bench 60 store --no-redis --no-mooncake --sizes 1MiB --clients 1
  done
  export PYTHONPATH="$PWD/src"; unset KVSTRATA_PLACEMENT_TABLE
}
store_twice() {  # bench store's device rows twice on the current code, both JSONs kept
  local v
  for v in 1 2; do bench 60 store --no-redis --no-mooncake --sizes 1MiB --clients 1; cp "$OUT/store.json" "$OUT/store_$v.json"; done
}
store_read_ab() {  # the client-device GPU tests, store_ab against ab_old/src, trace_store_device, probe_store_ab
  KVSTRATA_TEST_WAIT=20 timeout 120 python3 -m pytest -q -m "gpu or multigpu" -p no:cacheprovider --timeout 60 \
    tests/test_client_device.py tests/test_acquire_batches.py tests/test_landing.py 2>&1 | tail -3 | tee -a "$LOG"
  store_ab ab_old
  echo "=== tools/trace_store_device.py" >> "$LOG"; timeout 40 python3 tools/trace_store_device.py >> "$LOG" 2>&1
  echo "=== tools/probe_store_ab.py --iters 100" >> "$LOG"; timeout 90 python3 tools/probe_store_ab.py --iters 100 >> "$LOG" 2>&1
}
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader | tee "$LOG"
# The native module built (or loaded from the disk cache) before anything runs: a fresh machine has none, and a tool
# that starts its build in the background would time the Python path (session 31's second call did).
timeout 240 python3 -m kvstrata.cli.main native 2>&1 | tail -2 >> "$LOG"
if [ "${PART:-a}" = a ]; then
  KVSTRATA_TEST_WAIT=20 timeout 280 python3 -m pytest -q -m "gpu or multigpu" -p no:cacheprovider --timeout 120 \
    > "$OUT/gpu_tests.log" 2>&1
  tail -15 "$OUT/gpu_tests.log"
  bench 60 gather --quick
  bench 100 device --quick --broadcast-wait both --wait 30
  bench 60 store --no-redis --no-mooncake --sizes 1MiB --clients 1
elif [ "${PART}" = c ]; then
  KVSTRATA_TEST_WAIT=20 timeout 300 python3 -m pytest -q -m "gpu or multigpu" -p no:cacheprovider --timeout 120 \
    > "$OUT/gpu_tests.log" 2>&1
  tail -15 "$OUT/gpu_tests.log"
  KVSTRATA_DEVOBJ_TRACE=1 bench 150 device --quick --broadcast-gib 8 --wait 30
  bench 80 store --no-redis --no-mooncake --sizes 1MiB --clients 1
  bench 120 transfer --layers 80 --chunks-kib 32,128,512
elif [ "${PART}" = f ]; then  # session 4's closing call: every GPU test, then the benches' short forms, traced
  KVSTRATA_TEST_WAIT=20 timeout 270 python3 -m pytest -q -m "gpu or multigpu" -p no:cacheprovider --timeout 120 \
    > "$OUT/gpu_tests.log" 2>&1
  tail -15 "$OUT/gpu_tests.log"
  KVSTRATA_DEVOBJ_TRACE=1 bench 110 device --quick --broadcast-gib 8 --wait 30
  bench 70 store --no-redis --no-mooncake --sizes 1MiB --clients 1
  echo "=== tools/trace_store_device.py" >> "$LOG"; timeout 60 python3 tools/trace_store_device.py >> "$LOG" 2>&1
  bench 100 transfer --layers 32 --chunks-kib 16
elif [ "${PART}" = m ]; then  # mid-session check: every GPU test, then the three benches' short forms
  KVSTRATA_TEST_WAIT=20 timeout 260 python3 -m pytest -q -m "gpu or multigpu" -p no:cacheprovider --timeout 120 -x \
    > "$OUT/gpu_tests.log" 2>&1
  tail -15 "$OUT/gpu_tests.log"
  KVSTRATA_DEVOBJ_TRACE=1 bench 110 device --quick --wait 30
  bench 60 store --no-redis --no-mooncake --sizes 1MiB --clients 1
  bench 90 transfer --layers 32 --chunks-kib 16
elif [ "${PART}" = s5 ]; then  # session 5's check: every GPU test (no stop), probes of the changed paths, benches
  KVSTRATA_TEST_WAIT=20 timeout 270 python3 -m pytest -q -m "gpu or multigpu" -p no:cacheprovider --timeout 120 \
    > "$OUT/gpu_tests.log" 2>&1
  tail -15 "$OUT/gpu_tests.log"
  echo "=== tools/probe_store_load_host.py" >> "$LOG"; timeout 60 python3 tools/probe_store_load_host.py >> "$LOG" 2>&1
  echo "=== tools/trace_store_device.py" >> "$LOG"; timeout 60 python3 tools/trace_store_device.py >> "$LOG" 2>&1
  bench 100 transfer --layers 32 --chunks-kib 16
  KVSTRATA_DEVOBJ_TRACE=1 bench 90 device --quick --wait 30
  bench 60 store --no-redis --no-mooncake --sizes 1MiB --clients 1
elif [ "${PART}" = s5b ]; then  # session 5's second check: device objects, worker round trips, spin A/B
  KVSTRATA_TEST_WAIT=20 timeout 150 python3 -m pytest -q -m "gpu or multigpu" -p no:cacheprovider --timeout 60 \
    tests/test_devobj*.py tests/test_client_device.py tests/test_client_api.py tests/store tests/test_staging_plan.py \
    > "$OUT/gpu_tests.log" 2>&1
  tail -5 "$OUT/gpu_tests.log"
  KVSTRATA_DEVOBJ_TRACE=1 KVSTRATA_BENCH_PROFILE=1 bench 80 device --quick --wait 30
  rm -f "$OUT/device_quick.json"
  for env in "" KVSTRATA_DEVOBJ_RESULT_SPIN_US=0 KVSTRATA_DEVOBJ_EVENT_SPIN_US=2000; do
    echo "=== device bench with [$env]" >> "$LOG"
    env $env timeout 80 python3 -m kvstrata.cli.main bench device --quick --wait 30 --out "$OUT" 2>&1 | grep -E "hand-off|  64 MiB|   1 GiB" >> "$LOG"
  done
  rm -f "$OUT"/*.png
  for spin in "" 2000; do
    echo "=== tools/probe_worker_rt.py KVSTRATA_SPIN_US=$spin" >> "$LOG"
    env ${spin:+KVSTRATA_SPIN_US=$spin} timeout 40 python3 tools/probe_worker_rt.py >> "$LOG" 2>&1
  done
  echo "=== tools/probe_worker_phases.py" >> "$LOG"; timeout 40 python3 tools/probe_worker_phases.py --iters 300 >> "$LOG" 2>&1
  for opt in "" "--first-stage-mib 2 --first-batch-runs 4"; do
    echo "=== tools/trace_store_device.py $opt" >> "$LOG"; timeout 50 python3 tools/trace_store_device.py $opt >> "$LOG" 2>&1
  done
  bench 50 store --no-redis --no-mooncake --sizes 1MiB --clients 1
  echo "=== with KVSTRATA_SPIN_US=2000" >> "$LOG"
  KVSTRATA_SPIN_US=2000 bench 50 store --no-redis --no-mooncake --sizes 1MiB --clients 1
elif [ "${PART}" = s5f ]; then  # session 5's closing call: every GPU test, device objects (8 GiB broadcast), store, gather
  KVSTRATA_TEST_WAIT=20 timeout 270 python3 -m pytest -q -m "gpu or multigpu" -p no:cacheprovider --timeout 120 \
    > "$OUT/gpu_tests.log" 2>&1
  tail -15 "$OUT/gpu_tests.log"
  bench 90 device --quick --broadcast-gib 8 --wait 30
  bench 50 store --no-redis --no-mooncake --sizes 1MiB --clients 1
  bench 80 gather --quick
elif [ "${PART}" = s5t ]; then  # session 5's closing sweep: bench transfer over every chunk size, 32 and 80 layers
  bench 560 transfer
elif [ "${PART}" = s7a ]; then
  timeout 90 python3 -m pytest -q -m "gpu or multigpu" -p no:cacheprovider tests/test_client_device.py \
    tests/test_reservations.py tests/test_linger.py 2>&1 | tail -3 | tee -a "$LOG"
  for v in 1 0; do
    echo "=== tools/probe_call_phases.py --linger $v" >> "$LOG"
    timeout 60 python3 tools/probe_call_phases.py --iters 100 --linger $v >> "$LOG" 2>&1
  done
  echo "=== tools/probe_store_ab.py --iters 150" >> "$LOG"; timeout 200 python3 tools/probe_store_ab.py --iters 150 >> "$LOG" 2>&1
  echo "=== tools/trace_store_device.py" >> "$LOG"; timeout 60 python3 tools/trace_store_device.py >> "$LOG" 2>&1
elif [ "${PART}" = s7b ]; then
  timeout 90 python3 -m pytest -q -m "gpu or multigpu" -p no:cacheprovider tests/test_client_device.py \
    tests/test_reservations.py tests/test_linger.py tests/test_landing.py 2>&1 | tail -3 | tee -a "$LOG"
  echo "=== tools/probe_store_ab.py --iters 150" >> "$LOG"; timeout 200 python3 tools/probe_store_ab.py --iters 150 >> "$LOG" 2>&1
  echo "=== tools/probe_call_phases.py" >> "$LOG"; timeout 60 python3 tools/probe_call_phases.py --iters 100 >> "$LOG" 2>&1
  echo "=== tools/trace_store_device.py" >> "$LOG"; timeout 60 python3 tools/trace_store_device.py >> "$LOG" 2>&1
elif [ "${PART}" = s7f ]; then
  KVSTRATA_TEST_WAIT=20 timeout 270 python3 -m pytest -q -m "gpu or multigpu" -p no:cacheprovider --timeout 120 \
    > "$OUT/gpu_tests.log" 2>&1
  tail -15 "$OUT/gpu_tests.log"
  echo "=== tools/probe_store_ab.py --iters 120" >> "$LOG"; timeout 120 python3 tools/probe_store_ab.py --iters 120 >> "$LOG" 2>&1
  store_twice
  echo "=== tools/trace_store_device.py" >> "$LOG"; timeout 60 python3 tools/trace_store_device.py >> "$LOG" 2>&1
  for lead in 0 1; do
    echo "=== KVSTRATA_DEVOBJ_LEAD=$lead" >> "$LOG"
    KVSTRATA_DEVOBJ_LEAD=$lead bench 90 device --quick --broadcast-gib 2 --wait 30
    cp "$OUT/device_quick.json" "$OUT/device_quick_lead$lead.json"
  done
elif [ "${PART}" = s7g ]; then
  bench 120 device --quick --broadcast-gib 8 --wait 30
  cp "$OUT/device_quick.json" "$OUT/device_quick_final.json"
  echo "=== KVSTRATA_DEVOBJ_WORKER_SPIN_US=2000" >> "$LOG"
  KVSTRATA_DEVOBJ_WORKER_SPIN_US=2000 bench 90 device --quick --broadcast-gib 2 --wait 30
  for i in 1 2; do
    echo "=== tools/devobj_latency_cpu.py --iters 600 --ab" >> "$LOG"
    timeout 60 python3 tools/devobj_latency_cpu.py --iters 600 --ab >> "$LOG" 2>&1
  done
  echo "=== tools/probe_worker_phases.py" >> "$LOG"; timeout 90 python3 tools/probe_worker_phases.py --iters 200 >> "$LOG" 2>&1
  bench 60 gather --quick
elif [ "${PART}" = s8a ]; then
  echo "=== tools/probe_gather_floor.py" >> "$LOG"; timeout 90 python3 tools/probe_gather_floor.py >> "$LOG" 2>&1
  KVSTRATA_DEVOBJ_TRACE=1 bench 100 device --quick --broadcast-gib 2 --wait 30
  echo "=== tools/devobj_latency_cpu.py --iters 400 --trace" >> "$LOG"
  timeout 60 python3 tools/devobj_latency_cpu.py --iters 400 --trace >> "$LOG" 2>&1
  echo "=== tools/trace_store_device.py" >> "$LOG"; timeout 40 python3 tools/trace_store_device.py >> "$LOG" 2>&1
elif [ "${PART}" = s8b ]; then
  KVSTRATA_TEST_WAIT=20 timeout 200 python3 -m pytest -q -m "gpu or multigpu" -p no:cacheprovider --timeout 120 \
    tests/test_client_device.py tests/test_bench_gather.py tests/test_devobj_bench.py tests/test_acquire_batches.py \
    2>&1 | tail -3 | tee -a "$LOG"
  KVSTRATA_DEVOBJ_TRACE=1 bench 100 device --quick --broadcast-gib 2 --wait 30
  echo "=== tools/probe_store_ab.py --iters 100" >> "$LOG"; timeout 90 python3 tools/probe_store_ab.py --iters 100 >> "$LOG" 2>&1
  store_twice
  echo "=== tools/trace_store_device.py" >> "$LOG"; timeout 40 python3 tools/trace_store_device.py >> "$LOG" 2>&1
  bench 60 gather --quick
elif [ "${PART}" = s8c ] || [ "${PART}" = s8d ] || [ "${PART}" = s9a ]; then
  store_read_ab
  if [ "${PART}" = s8c ]; then KVSTRATA_DEVOBJ_TRACE=1 bench 100 device --quick --broadcast-gib 2 --wait 30; fi
elif [ "${PART}" = s9b ]; then
  echo "=== tools/probe_placements.py" >> "$LOG"; timeout 60 python3 tools/probe_placements.py >> "$LOG" 2>&1
  table_ab new off ab_old new off ab_old
  echo "=== tools/trace_store_device.py --profile" >> "$LOG"
  timeout 120 python3 tools/trace_store_device.py --profile >> "$LOG" 2>&1
elif [ "${PART}" = s9c ]; then
  for v in ab_old ab_fewer new ab_old ab_fewer new; do
    use "$v"
    echo "=== ($v code)" >> "$LOG"; bench 60 store --no-redis --no-mooncake --sizes 1MiB --clients 1
  done
  for v in ab_old ab_fewer new; do
    use "$v"
    echo "=== tools/trace_store_device.py ($v code)" >> "$LOG"; timeout 40 python3 tools/trace_store_device.py >> "$LOG" 2>&1
  done
  export PYTHONPATH="$PWD/src"
elif [ "${PART}" = s9d ]; then
  KVSTRATA_TEST_WAIT=20 timeout 120 python3 -m pytest -q -m "gpu or multigpu" -p no:cacheprovider --timeout 60 \
    tests/test_client_device.py tests/test_acquire_batches.py tests/test_landing.py 2>&1 | tail -3 | tee -a "$LOG"
  table_ab new off ab_old new off ab_old
  echo "=== tools/trace_store_device.py" >> "$LOG"; timeout 40 python3 tools/trace_store_device.py >> "$LOG" 2>&1
elif [ "${PART}" = s9z ]; then
  KVSTRATA_TEST_WAIT=20 timeout 280 python3 -m pytest -q -m "gpu or multigpu" -p no:cacheprovider --timeout 120 \
    > "$OUT/gpu_tests_final.log" 2>&1
  tail -3 "$OUT/gpu_tests_final.log" | tee -a "$LOG"
  store_twice
  echo "=== tools/trace_store_device.py" >> "$LOG"; timeout 40 python3 tools/trace_store_device.py >> "$LOG" 2>&1
  echo "=== tools/probe_placements.py" >> "$LOG"; timeout 60 python3 tools/probe_placements.py >> "$LOG" 2>&1
elif [ "${PART}" = s10a ]; then
  KVSTRATA_TEST_WAIT=20 timeout 120 python3 -m pytest -q -m "gpu or multigpu" -p no:cacheprovider --timeout 60 \
    tests/test_client_device.py tests/test_acquire_batches.py tests/test_landing.py 2>&1 | tail -3 | tee -a "$LOG"
  for v in ab_old new ab_old new; do
    use "$v"
    echo "=== ($v code)" >> "$LOG"; bench 60 store --no-redis --no-mooncake --sizes 1MiB --clients 1
    echo "=== tools/trace_store_device.py ($v code)" >> "$LOG"; timeout 40 python3 tools/trace_store_device.py >> "$LOG" 2>&1
  done
  export PYTHONPATH="$PWD/src"
elif [ "${PART}" = s10b ]; then
  KVSTRATA_TEST_WAIT=20 timeout 120 python3 -m pytest -q -m "gpu or multigpu" -p no:cacheprovider --timeout 60 \
    tests/test_client_device.py tests/test_acquire_batches.py tests/test_landing.py 2>&1 | tail -3 | tee -a "$LOG"
  for v in 1 2; do
    echo "=== tools/probe_cold_ab.py --iters 100 ($v)" >> "$LOG"; timeout 120 python3 tools/probe_cold_ab.py --iters 100 >> "$LOG" 2>&1
  done
  echo "=== tools/trace_store_device.py" >> "$LOG"; timeout 40 python3 tools/trace_store_device.py >> "$LOG" 2>&1
elif [ "${PART}" = s10z ]; then
  KVSTRATA_TEST_WAIT=20 timeout 280 python3 -m pytest -q -m "gpu or multigpu" -p no:cacheprovider --timeout 120 \
    > "$OUT/gpu_tests_final.log" 2>&1
  tail -3 "$OUT/gpu_tests_final.log" | tee -a "$LOG"
  store_twice
  echo "=== tools/probe_cold_ab.py --iters 100" >> "$LOG"; timeout 120 python3 tools/probe_cold_ab.py --iters 100 >> "$LOG" 2>&1
  echo "=== tools/trace_store_device.py" >> "$LOG"; timeout 40 python3 tools/trace_store_device.py >> "$LOG" 2>&1
elif [ "${PART}" = s11a ]; then
  KVSTRATA_TEST_WAIT=20 timeout 200 python3 -m pytest -q -m "gpu or multigpu" -p no:cacheprovider --timeout 60 \
    tests/test_devobj_*.py 2>&1 | tail -15 | tee -a "$LOG"
  for d in 0,0 0,1; do
    echo "=== tools/probe_handoff.py --devices $d --iters 150 --trace" >> "$LOG"
    timeout 120 python3 tools/probe_handoff.py --devices $d --iters 150 --trace >> "$LOG" 2>&1
  done
  bench 150 device --quick --wait 30
elif [ "${PART}" = s11b ]; then
  KVSTRATA_TEST_WAIT=20 timeout 200 python3 -m pytest -q -m "gpu or multigpu" -p no:cacheprovider --timeout 60 \
    tests/test_devobj_*.py 2>&1 | tail -15 | tee -a "$LOG"
  echo "=== tools/probe_pause.py" >> "$LOG"; timeout 30 python3 tools/probe_pause.py >> "$LOG" 2>&1
  for d in 0,0 0,1; do
    echo "=== tools/probe_handoff.py --devices $d --iters 120 --variants on,off,first --trace" >> "$LOG"
    timeout 120 python3 tools/probe_handoff.py --devices $d --iters 120 --variants on,off,first --trace >> "$LOG" 2>&1
  done
  echo "=== KVSTRATA_DEVOBJ_LEAD_PAUSE=yield tools/probe_handoff.py --devices 0,1 --iters 120 --trace" >> "$LOG"
  KVSTRATA_DEVOBJ_LEAD_PAUSE=yield timeout 120 python3 tools/probe_handoff.py --devices 0,1 --iters 120 --trace >> "$LOG" 2>&1
  bench 150 device --quick --wait 30
elif [ "${PART}" = s11c ]; then
  for d in 0,1 0,0; do
    echo "=== tools/probe_handoff.py --devices $d --iters 120 --variants on,off,first --trace" >> "$LOG"
    timeout 120 python3 tools/probe_handoff.py --devices $d --iters 120 --variants on,off,first --trace >> "$LOG" 2>&1
  done
elif [ "${PART}" = s11d ]; then
  for d in "--dst 0" "--dst 1" "--dst 1 --idle 0.005"; do
    echo "=== tools/probe_cold_copy.py $d" >> "$LOG"; timeout 60 python3 tools/probe_cold_copy.py $d >> "$LOG" 2>&1
  done
  echo "=== tools/probe_pause.py" >> "$LOG"; timeout 30 python3 tools/probe_pause.py >> "$LOG" 2>&1
elif [ "${PART}" = s14a ]; then
  gpu_tests gpu_tests_final
  for d in 0,1 0,0; do
    echo "=== tools/probe_handoff_floor.py --devices $d --iters 100" >> "$LOG"
    timeout 90 python3 tools/probe_handoff_floor.py --devices $d --iters 100 >> "$LOG" 2>&1
  done
  echo "=== tools/probe_handoff.py --devices 0,1 --iters 120 --trace" >> "$LOG"
  timeout 100 python3 tools/probe_handoff.py --devices 0,1 --iters 120 --trace 2>&1 | grep -v Producer >> "$LOG"
  store_twice
elif [ "${PART}" = s14b ]; then
  echo "=== tools/probe_handoff_steps.py --reps 3000" >> "$LOG"
  timeout 120 python3 tools/probe_handoff_steps.py --reps 3000 >> "$LOG" 2>&1
elif [ "${PART}" = s14c ]; then
  { echo "=== host idle states"; cat /sys/devices/system/cpu/cpuidle/current_driver /sys/devices/system/cpu/cpuidle/current_governor* 2>&1
    grep -H . /sys/devices/system/cpu/cpu0/cpuidle/state*/name /sys/devices/system/cpu/cpu0/cpuidle/state*/latency 2>&1
    cat /sys/devices/system/cpu/cpu0/cpufreq/scaling_governor 2>&1; ls -l /dev/cpu_dma_latency 2>&1; id -u
    grep -m1 "model name" /proc/cpuinfo; grep -c processor /proc/cpuinfo; grep -o hypervisor /proc/cpuinfo | head -1; } >> "$LOG"
  for hold in 0 1 0 1; do
    pid=
    if [ $hold = 1 ]; then
      python3 -c "import os,struct,time; fd=os.open('/dev/cpu_dma_latency',os.O_WRONLY); os.write(fd,struct.pack('i',0)); print('held', flush=True); time.sleep(900)" >> "$LOG" 2>&1 &
      pid=$!; sleep 1
    fi
    echo "=== PM QoS hold $hold: tools/probe_handoff_floor.py --devices 0,1 --iters 60" >> "$LOG"
    timeout 80 python3 tools/probe_handoff_floor.py --devices 0,1 --iters 60 >> "$LOG" 2>&1
    echo "=== PM QoS hold $hold: tools/probe_handoff.py --devices 0,1 --iters 60" >> "$LOG"
    timeout 90 python3 tools/probe_handoff.py --devices 0,1 --iters 60 2>&1 | grep -v Producer >> "$LOG"
    [ -n "$pid" ] && kill $pid
  done
elif [ "${PART}" = s14d ]; then
  echo "=== tools/probe_async_calls.py --iters 8" >> "$LOG"
  timeout 120 python3 tools/probe_async_calls.py --iters 8 >> "$LOG" 2>&1
  echo "=== tools/trace_store_device.py" >> "$LOG"; timeout 60 python3 tools/trace_store_device.py >> "$LOG" 2>&1
elif [ "${PART}" = s14e ]; then
  KVSTRATA_TEST_WAIT=20 timeout 200 python3 -m pytest -q -m "gpu or multigpu" -p no:cacheprovider --timeout 60 \
    tests/test_client_api.py tests/test_client_device.py tests/test_acquire_batches.py tests/test_landing.py \
    tests/test_reservations.py tests/test_copies_future.py 2>&1 | tail -3 | tee -a "$LOG"
  echo "=== tools/probe_async_calls.py --iters 8" >> "$LOG"
  timeout 120 python3 tools/probe_async_calls.py --iters 8 >> "$LOG" 2>&1
  store_twice
elif [ "${PART}" = s14f ] || [ "${PART}" = s14h ]; then
  KVSTRATA_TEST_WAIT=20 timeout 200 python3 -m pytest -q -m "gpu or multigpu" -p no:cacheprovider --timeout 60 \
    tests/test_client_api.py tests/test_client_device.py tests/test_acquire_batches.py tests/test_landing.py \
    tests/test_reservations.py tests/test_copies_future.py 2>&1 | tail -3 | tee -a "$LOG"
  store_ab ab_old
  echo "=== tools/probe_async_calls.py --iters 8" >> "$LOG"
  timeout 120 python3 tools/probe_async_calls.py --iters 8 >> "$LOG" 2>&1
elif [ "${PART}" = s14g ]; then
  gpu_tests gpu_tests_final
  store_ab ab_old
  echo "=== tools/probe_async_calls.py --iters 8" >> "$LOG"
  timeout 120 python3 tools/probe_async_calls.py --iters 8 >> "$LOG" 2>&1
  bench 150 device --quick --broadcast-gib 8 --wait 30
elif [ "${PART}" = s14i ]; then
  KVSTRATA_TEST_WAIT=20 timeout 200 python3 -m pytest -q -m "gpu or multigpu" -p no:cacheprovider --timeout 60 \
    tests/test_client_api.py tests/test_copies_future.py tests/test_client_device.py 2>&1 | tail -5 | tee -a "$LOG"
elif [ "${PART}" = s14j ]; then
  store_ab ab_old
elif [ "${PART}" = s15a ]; then
  gpu_tests gpu_tests_s15a
  nproc >> "$LOG"
  for v in "1 200" "8 200" "1 0"; do
    set -- $v
    echo "=== tools/probe_worker_clients.py XSPIN_N=$1 --spin-us $2" >> "$LOG"
    XSPIN_N=$1 timeout 90 python3 tools/probe_worker_clients.py --clients 1,2,4,8 --spin-us $2 >> "$LOG" 2>&1
  done
  bench 120 store --no-redis --no-mooncake --sizes 4KiB,1MiB --clients 1,8
elif [ "${PART}" = s15b ]; then
  nproc >> "$LOG"
  for v in ab_old new ab_old new; do
    use "$v"
    echo "=== tools/probe_worker_clients.py ($v code)" >> "$LOG"
    timeout 90 python3 tools/probe_worker_clients.py --clients 1,2,4,8,16 >> "$LOG" 2>&1
  done
  export PYTHONPATH="$PWD/src"
  store_ab ab_old
  bench 200 device --quick
elif [ "${PART}" = s15c ]; then
  nproc >> "$LOG"
  for v in ab_old ab_poll new ab_old ab_poll new; do
    use "$v"
    echo "=== tools/probe_worker_clients.py ($v code)" >> "$LOG"
    timeout 90 python3 tools/probe_worker_clients.py --clients 1,2,4,8,16,24 >> "$LOG" 2>&1
  done
  export PYTHONPATH="$PWD/src"
elif [ "${PART}" = s15d ]; then
  for v in new new new ab_poll; do
    use "$v"
    echo "=== tools/probe_worker_clients.py ($v code)" >> "$LOG"
    timeout 90 python3 tools/probe_worker_clients.py --clients 1,2,4,8,16,24 >> "$LOG" 2>&1
  done
  export PYTHONPATH="$PWD/src"
elif [ "${PART}" = s15e ]; then
  gpu_tests gpu_tests_s15e
  for v in ab_old new ab_old new; do
    use "$v"
    echo "=== tools/probe_worker_clients.py ($v code)" >> "$LOG"
    timeout 90 python3 tools/probe_worker_clients.py --clients 1,2,4,8,16,24 >> "$LOG" 2>&1
  done
  export PYTHONPATH="$PWD/src"
  bench 120 store --no-redis --no-mooncake --sizes 4KiB --clients 1,8
elif [ "${PART}" = s15f ]; then
  bench 200 device --quick
elif [ "${PART}" = s15g ]; then
  for v in ab_old new sw ab_old new sw; do
    unset XSW
    case $v in
      new) export PYTHONPATH="$PWD/src" ;;
      sw) export PYTHONPATH="$PWD/src" XSW=0.0005 ;;
      *) export PYTHONPATH="$PWD/$v/src" ;;
    esac
    echo "=== tools/probe_worker_mixed.py --writers 8 ($v code)" >> "$LOG"
    timeout 60 python3 tools/probe_worker_mixed.py --writers 8 --seconds 6 >> "$LOG" 2>&1
  done
  unset XSW; export PYTHONPATH="$PWD/src"
elif [ "${PART}" = s16a ]; then
  gpu_tests gpu_tests_s16a
  nproc >> "$LOG"
  for v in ab_poll new ab_poll new; do
    use "$v"
    echo "=== tools/probe_worker_mixed.py --writers 8 ($v code)" >> "$LOG"
    timeout 60 python3 tools/probe_worker_mixed.py --writers 8 --seconds 6 >> "$LOG" 2>&1
  done
  export PYTHONPATH="$PWD/src"
  for w in 0 1 0 1; do
    echo "=== tools/probe_worker_mixed.py --writers $w --connect" >> "$LOG"
    timeout 60 python3 tools/probe_worker_mixed.py --writers $w --connect --calls 300 --seconds 6 >> "$LOG" 2>&1
  done
  for v in new ab_poll new; do
    use "$v"
    echo "=== tools/probe_worker_clients.py ($v code)" >> "$LOG"
    timeout 90 python3 tools/probe_worker_clients.py --clients 1,2,4,8,16,24 >> "$LOG" 2>&1
  done
  export PYTHONPATH="$PWD/src"
  bench 150 device --quick
elif [ "${PART}" = s17a ]; then
  gpu_tests gpu_tests_s17a
  nproc >> "$LOG"
  for v in ab_old new ab_old new; do
    use $v; echo "=== tools/probe_worker_mixed.py --writers 1 --connect ($v code)" >> "$LOG"
    timeout 60 python3 tools/probe_worker_mixed.py --writers 1 --connect --calls 300 --seconds 6 >> "$LOG" 2>&1
  done
  for v in ab_old new; do
    use $v; echo "=== tools/probe_worker_mixed.py --writers 0 --connect ($v code)" >> "$LOG"
    timeout 60 python3 tools/probe_worker_mixed.py --writers 0 --connect --calls 300 --seconds 6 >> "$LOG" 2>&1
  done
  for v in ab_old new; do
    use $v; echo "=== tools/probe_worker_mixed.py --writers 8 ($v code)" >> "$LOG"
    timeout 60 python3 tools/probe_worker_mixed.py --writers 8 --seconds 6 >> "$LOG" 2>&1
  done
  for v in new ab_old new; do
    use $v; echo "=== tools/probe_worker_clients.py ($v code)" >> "$LOG"
    timeout 90 python3 tools/probe_worker_clients.py --clients 1,2,4,8,16,24 >> "$LOG" 2>&1
  done
  use new
  bench 150 device --quick
elif [ "${PART}" = s17b ]; then
  nproc >> "$LOG"
  tick_rounds 3 new ab_nonap ab_old
elif [ "${PART}" = s17c ]; then
  gpu_tests gpu_tests_s17c
  nproc >> "$LOG"
  for r in 1 2; do
    echo "=== tools/probe_worker_mixed.py --writers 1 --connect (round $r)" >> "$LOG"
    timeout 60 python3 tools/probe_worker_mixed.py --writers 1 --connect --calls 300 --seconds 6 >> "$LOG" 2>&1
  done
  echo "=== tools/probe_worker_mixed.py --writers 8" >> "$LOG"
  timeout 60 python3 tools/probe_worker_mixed.py --writers 8 --seconds 6 >> "$LOG" 2>&1
  tick_rounds 3 new ab_old
  bench 150 device --quick
elif [ "${PART}" = s17d ]; then
  nproc >> "$LOG"
  for v in ab_old new ab_mix ab_mix new ab_old new ab_old ab_mix ab_old ab_mix new; do
    use "$v"
    echo "=== tools/probe_worker_clients.py --clients 1,2,4 ($v code)" >> "$LOG"
    timeout 60 python3 tools/probe_worker_clients.py --clients 1,2,4 >> "$LOG" 2>&1
  done
  export PYTHONPATH="$PWD/src"
elif [ "${PART}" = s17e ]; then
  nproc >> "$LOG"
  for v in ab_old new ab_ysched new ab_ysched ab_old ab_ysched ab_old new ab_old ab_ysched new; do
    use "$v"
    echo "=== tools/probe_worker_clients.py --clients 1 ($v code)" >> "$LOG"
    timeout 40 python3 tools/probe_worker_clients.py --clients 1 >> "$LOG" 2>&1
  done
  export PYTHONPATH="$PWD/src"
elif [ "${PART}" = s19c ] || [ "${PART}" = s19d ] || [ "${PART}" = s19z ]; then
  flags="--peer-busy"
  [ "${PART}" = s19c ] && flags="- -"
  [ "${PART}" = s19d ] && flags="--peer-busy - --peer-busy"
  [ "${PART}" = s19z ] && flags="--peer-busy -"
  for f in $flags; do
    [ "$f" = - ] && f=""
    echo "=== tools/probe_timeslice_copy.py --devices ${DEVS} --iters 200 $f" >> "$LOG"
    timeout 120 python3 tools/probe_timeslice_copy.py --devices "${DEVS}" --iters 200 $f 2>&1 | grep -v Producer >> "$LOG"
  done
  if [ "${PART}" = s19z ]; then
    echo "=== tools/probe_handoff.py --devices ${DEVS} --iters 150" >> "$LOG"
    timeout 200 python3 tools/probe_handoff.py --devices "${DEVS}" --iters 150 2>&1 | grep -v Producer >> "$LOG"
    gpu_tests gpu_tests_s19z
  fi
elif [ "${PART}" = s25a ]; then
  tool_runs 3 probe_call_variants --rounds 100
elif [ "${PART}" = s25b ]; then
  tool_runs 2 probe_call_variants --rounds 100
  for j in 0 1 1 0; do
    echo "=== KVSTRATA_JOIN_LEGACY=$j" >> "$LOG"
    KVSTRATA_JOIN_LEGACY=$j bench 60 store --no-redis --no-mooncake --sizes 1MiB --clients 1
  done
elif [ "${PART}" = s25c ]; then
  tool_runs 2 probe_call_variants --rounds 100
  gpu_tests gpu_tests_s25c
  store_rows new new
elif [ "${PART}" = s25d ]; then
  gpu_tests gpu_tests_s25d
  tool_runs 1 probe_call_variants --rounds 100
  store_rows new new new
elif [ "${PART}" = s25e ]; then
  gpu_tests gpu_tests_s25e
  tool_runs 2 probe_call_variants --rounds 100 --holds
  store_rows new new
elif [ "${PART}" = s25f ]; then
  gpu_tests gpu_tests_s25f
  store_rows new new
  tool_runs 1 probe_call_variants --rounds 100 --holds
  tool_runs 1 probe_handoff --devices 0,0 --iters 150 --variants on
  store_rows new
elif [ "${PART}" = s26a ]; then
  gpu_tests gpu_tests_s26a
  store_rows ab_old new new ab_old ab_old new
  for v in ab_old new ab_old new; do
    use "$v"; echo "=== ($v code)" >> "$LOG"; tool_runs 1 probe_kept_quiet --rounds 100
  done
  use new
elif [ "${PART}" = s26b ] || [ "${PART}" = s26c ]; then
  for v in ab_old new new ab_old; do
    use "$v"; echo "=== ($v code)" >> "$LOG"
    tool_runs 1 probe_call_steps --rounds 200
    tool_runs 1 probe_call_steps --rounds 200 --sleep-ms 2
  done
  use new
  if [ "${PART}" = s26b ]; then store_rows ab_old new new ab_old; else store_rows ab_old new new ab_old ab_old new; fi
elif [ "${PART}" = s26d ]; then
  tool_runs 1 probe_call_steps --op mset --batches 3 --rounds 200
  tool_runs 1 probe_call_steps --op mset --batches 3 --rounds 200 --sleep-ms 2
  tool_runs 1 probe_call_steps --op kept --batches 3 --rounds 200
elif [ "${PART}" = s26e ]; then
  gpu_tests gpu_tests_s26e
  tool_runs 1 probe_call_steps --op mset --batches 3 --rounds 200
  tool_runs 1 probe_call_steps --op kept --batches 3 --rounds 200
  store_rows ab_old new new ab_old ab_old new
elif [ "${PART}" = s26f ]; then
  gpu_tests gpu_tests_s26f
  tool_runs 1 probe_call_steps --op mset --batches 4 --rounds 200
  tool_runs 1 probe_call_steps --op kept --batches 4 --rounds 200
  store_rows ab_old new new ab_old
elif [ "${PART}" = s26g ]; then
  store_twice
elif [ "${PART}" = s26h ]; then
  store_rows ab_old new new ab_old ab_old new
elif [ "${PART}" = s27a ]; then
  tool_runs 3 probe_copy_engines --iters 100
  store_rows new new
elif [ "${PART}" = s27b ]; then
  gpu_tests gpu_tests_s27b
  for v in ab_old new ab_old new; do
    use "$v"; echo "=== ($v code)" >> "$LOG"; tool_runs 1 probe_call_steps --op kept --rounds 200
  done
  store_rows ab_old new new ab_old ab_old new
elif [ "${PART}" = s27c ]; then
  store_rows new ab_old ab_old new new ab_old
  cp "$OUT/store.json" "$OUT/store_last_ab_old.json"
  store_rows new
elif [ "${PART}" = s27d ]; then
  store_rows new new new new new new new new
elif [ "${PART}" = s27e ]; then
  tool_runs 4 probe_batch_growth --first --rounds 150
elif [ "${PART}" = s27f ]; then
  gpu_tests gpu_tests_s27f
  tool_runs 2 probe_batch_growth --first --rounds 150
  store_rows ab_old new new ab_old ab_old new
elif [ "${PART}" = s27g ]; then
  store_rows new new new new new new
elif [ "${PART}" = s27h ]; then
  gpu_tests gpu_tests_s27h
elif [ "${PART}" = s27i ]; then
  tool_runs 2 probe_batch_growth --first --rounds 100
elif [ "${PART}" = s28a ]; then
  echo "=== the native planner's build" >> "$LOG"
  python3 -c "import time; from kvstrata.ops import tensor_runs as t; a = time.time(); m = t.native(wait=True); print(m, f'{time.time() - a:.1f} s')" >> "$LOG" 2>&1
  gpu_tests gpu_tests_s28a
  tool_runs 2 probe_batch_growth --native --rounds 150
  store_rows ab_old new new ab_old ab_old new
elif [ "${PART}" = s28b ]; then
  store_rows nonative new ab_old new nonative ab_old ab_old nonative new
elif [ "${PART}" = s28c ]; then
  tool_runs 2 probe_native_planner --rounds 100
elif [ "${PART}" = s28d ]; then
  tool_runs 2 probe_native_planner --rounds 100
elif [ "${PART}" = s28e ]; then
  gpu_tests gpu_tests_s28e
  tool_runs 1 probe_native_planner --rounds 100
  store_rows nonative new nonative new
elif [ "${PART}" = s28f ]; then
  gpu_tests gpu_tests_s28f
  tool_runs 2 probe_native_planner --rounds 100
  store_rows nonative new nonative new
elif [ "${PART}" = s28g ]; then
  gpu_tests gpu_tests_s28g
  tool_runs 1 probe_native_planner --rounds 100
  store_rows new nonative new
elif [ "${PART}" = s29a ]; then
  python3 -m kvstrata.cli.main native 2>&1 | tee -a "$LOG"
  gpu_tests gpu_tests_s29a
  grep -E "FAIL|Error" "$OUT/gpu_tests_s29a.log" | head -20 >> "$LOG"
  tool_runs 1 probe_native_planner
  store_rows new nocopies new nocopies
elif [ "${PART}" = s29b ]; then
  gpu_tests gpu_tests_s29b
  grep -E "^FAILED|^E " "$OUT/gpu_tests_s29b.log" | head -30 >> "$LOG"
  tool_runs 1 probe_native_planner
  store_rows new ab_old nocopies new ab_old nocopies
elif [ "${PART}" = s29c ]; then
  gpu_tests gpu_tests_s29c
  grep -E "^FAILED|^E " "$OUT/gpu_tests_s29c.log" | head -30 >> "$LOG"
  tool_runs 2 probe_native_planner
  store_rows new nocopies new nocopies new
  cp "$OUT/store.json" "$OUT/store_final.json"
elif [ "${PART}" = s29d ]; then
  gpu_tests gpu_tests_s29d
  grep -E "^FAILED|^E " "$OUT/gpu_tests_s29d.log" | head -30 >> "$LOG"
  tool_runs 1 probe_native_planner
  store_rows new nocopies new
  cp "$OUT/store.json" "$OUT/store_final.json"
elif [ "${PART}" = s29e ]; then
  gpu_tests gpu_tests_s29e
  grep -E "^FAILED|^E " "$OUT/gpu_tests_s29e.log" | head -30 >> "$LOG"
  tool_runs 2 probe_native_planner
  store_rows new new new
  cp "$OUT/store.json" "$OUT/store_final.json"
elif [ "${PART}" = s29f ]; then
  python3 -m kvstrata.cli.main native 2>&1 | tee -a "$LOG"
  for r in 1 2 3 4; do store_rows new; cp "$OUT/store.json" "$OUT/store_$r.json"; done
elif [ "${PART}" = s30a ]; then
  gpu_tests gpu_tests_s30a
  grep -E "^FAILED|^E " "$OUT/gpu_tests_s30a.log" | head -30 >> "$LOG"
  tool_runs 2 probe_native_planner
  store_rows new ab_old new ab_old new ab_old
  cp "$OUT/store.json" "$OUT/store_final.json"
elif [ "${PART}" = s30b ]; then
  tool_runs 2 probe_native_planner --variants "py prefix+join,py join,all native"
  tool_runs 1 probe_call_steps --op kept --rounds 300
  tool_runs 1 probe_call_steps --op mset --rounds 300
  tool_runs 1 probe_call_steps --op kept --rounds 300 --batches 2
  for r in 1 2 3; do store_rows new; cp "$OUT/store.json" "$OUT/store_$r.json"; done
elif [ "${PART}" = s30c ]; then
  gpu_tests gpu_tests_s30c
  grep -E "^FAILED|^E " "$OUT/gpu_tests_s30c.log" | head -30 >> "$LOG"
  tool_runs 1 probe_call_steps --op kept --rounds 300
  tool_runs 1 probe_call_steps --op mset --rounds 300
  tool_runs 1 probe_native_planner --variants "py prefix+join,all native"
  store_rows new ab_old new ab_old
  cp "$OUT/store.json" "$OUT/store_final.json"
elif [ "${PART}" = s30d ]; then
  tool_runs 1 probe_native_planner --variants "py prefix+join,all native"
  for v in new ab_old new new new ab_old new new; do store_rows "$v"; cp "$OUT/store.json" "$OUT/store_$v.json"; done
elif [ "${PART}" = s30e ]; then
  gpu_tests gpu_tests_s30e
  grep -E "^FAILED|^E " "$OUT/gpu_tests_s30e.log" | head -30 >> "$LOG"
  for r in 1 2 3 4; do store_rows new; cp "$OUT/store.json" "$OUT/store_$r.json"; done
elif [ "${PART}" = s30f ]; then
  KVSTRATA_TEST_WAIT=20 timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_placed_reads.py \
    tests/test_client_device.py tests/test_kept_reads.py > "$OUT/gpu_tests_s30f.log" 2>&1
  tail -3 "$OUT/gpu_tests_s30f.log" >> "$LOG"
  for r in 1 2 3; do store_rows new; cp "$OUT/store.json" "$OUT/store_$r.json"; done
elif [ "${PART}" = s31a ]; then
  gpu_tests gpu_tests_s31a
  grep -E "^FAILED|^E " "$OUT/gpu_tests_s31a.log" | head -30 >> "$LOG"
  tool_runs 2 probe_call_steps --op mset --rounds 300
  for r in 1 2; do store_rows new; cp "$OUT/store.json" "$OUT/store_$r.json"; done
elif [ "${PART}" = s31b ]; then
  tool_runs 1 probe_host_calls --rounds 300
  for r in 1 2; do
    for v in ab_old new; do
      use "$v"; echo "=== ($v code)" >> "$LOG"; tool_runs 1 probe_call_steps --op mset --rounds 300
    done
  done
  use new
  store_rows ab_old new ab_old new
elif [ "${PART}" = s31c ]; then
  tool_runs 1 probe_host_calls --rounds 200
  for v in ab_old new; do
    use "$v"; echo "=== ($v code)" >> "$LOG"; tool_runs 1 probe_call_steps --op mset --rounds 300
  done
  use new
  store_rows ab_old new ab_old new
elif [ "${PART}" = s31d ]; then
  tool_runs 1 probe_call_steps --op mset --rounds 300
  for r in 1 2 3; do
    for v in ab_old new; do store_rows "$v"; cp "$OUT/store.json" "$OUT/store_${v}_$r.json"; done
  done
elif [ "${PART}" = s31e ]; then
  gpu_tests gpu_tests_s31e
  grep -E "^FAILED|^E " "$OUT/gpu_tests_s31e.log" | head -30 >> "$LOG"
  tool_runs 1 probe_call_steps --op mset --rounds 300
  for r in 1 2 3 4; do store_rows new; cp "$OUT/store.json" "$OUT/store_$r.json"; done
elif [ "${PART}" = s32a ]; then
  gpu_tests gpu_tests_s32a
  grep -E "^FAILED|^E " "$OUT/gpu_tests_s32a.log" | head -30 >> "$LOG"
  PYTHONPATH="$PWD/ab_old/src" timeout 120 python3 -m kvstrata.cli.main native 2>&1 | tail -1 >> "$LOG"
  tool_runs 1 probe_native_planner --rounds 100
  store_rows ab_old new ab_old new
  tool_runs 1 probe_native_planner --rounds 100
elif [ "${PART}" = s32b ]; then
  gpu_tests gpu_tests_s32b
  grep -E "^FAILED|^E " "$OUT/gpu_tests_s32b.log" | head -30 >> "$LOG"
  tool_runs 2 probe_native_planner --rounds 60
  store_rows ab_old new ab_old new
elif [ "${PART}" = s32c ]; then
  gpu_tests gpu_tests_s32c
  grep -E "^FAILED|^E " "$OUT/gpu_tests_s32c.log" | head -30 >> "$LOG"
  for r in 1 2; do
    use ab_old; echo "=== (ab_old code)" >> "$LOG"; tool_runs 1 probe_native_planner --rounds 60 --variants "all native"
    use new; echo "=== (new code)" >> "$LOG"; tool_runs 1 probe_native_planner --rounds 60
  done
  store_rows ab_old new ab_old new
elif [ "${PART}" = s32d ]; then
  gpu_tests gpu_tests_s32d
  grep -E "^FAILED|^E " "$OUT/gpu_tests_s32d.log" | head -30 >> "$LOG"
  for v in ab_old new; do
    use "$v"; echo "=== ($v code)" >> "$LOG"; tool_runs 1 probe_native_planner --rounds 60 --variants "all native"
  done
  use new
  store_rows new ab_old new ab_old new
elif [ "${PART}" = s32e ]; then
  KVSTRATA_TEST_WAIT=20 timeout 200 python3 -m pytest -q -m "gpu or multigpu" -p no:cacheprovider --timeout 120 \
    tests/test_client_device.py tests/test_placed_reads.py tests/test_landing.py tests/test_kept_reads.py \
    tests/test_reservations.py > "$OUT/gpu_tests_s32e.log" 2>&1
  tail -1 "$OUT/gpu_tests_s32e.log" >> "$LOG"
  grep -E "^FAILED|^E " "$OUT/gpu_tests_s32e.log" | head -30 >> "$LOG"
  store_rows new ab_old new
elif [ "${PART}" = s33a ]; then
  gpu_tests gpu_tests_s33a
  grep -E "^FAILED|^E " "$OUT/gpu_tests_s33a.log" | head -30 >> "$LOG"
  for r in 1 2; do
    for v in ab_old new; do
      use "$v"; echo "=== ($v code)" >> "$LOG"; tool_runs 1 probe_native_planner --rounds 60 --variants "all native"
    done
  done
  store_rows ab_old new ab_old new
elif [ "${PART}" = s33b ]; then
  KVSTRATA_TEST_WAIT=20 timeout 200 python3 -m pytest -q -m "gpu or multigpu" -p no:cacheprovider --timeout 120 \
    tests/test_client_device.py tests/test_placed_reads.py tests/test_landing.py tests/test_kept_reads.py \
    tests/test_reservations.py tests/test_acquire_batches.py > "$OUT/gpu_tests_s33b.log" 2>&1
  tail -1 "$OUT/gpu_tests_s33b.log" >> "$LOG"
  grep -E "^FAILED|^E " "$OUT/gpu_tests_s33b.log" | head -30 >> "$LOG"
  echo "=== tools/probe_cold_phases.py --rounds 40 --send-after 1,2" >> "$LOG"
  timeout 150 python3 tools/probe_cold_phases.py --rounds 40 --send-after 1,2 >> "$LOG" 2>&1
  for r in 1 2; do
    for v in ab_old new; do
      use "$v"; echo "=== ($v code)" >> "$LOG"; tool_runs 1 probe_native_planner --rounds 40 --variants "all native"
    done
  done
  store_rows new ab_old new
elif [ "${PART}" = s33c ]; then
  gpu_tests gpu_tests_s33c
  grep -E "^FAILED|^E " "$OUT/gpu_tests_s33c.log" | head -30 >> "$LOG"
  echo "=== tools/probe_cold_phases.py --rounds 40" >> "$LOG"
  timeout 120 python3 tools/probe_cold_phases.py --rounds 40 >> "$LOG" 2>&1
  for v in new ab_old; do
    use "$v"; echo "=== ($v code)" >> "$LOG"; tool_runs 1 probe_native_planner --rounds 40 --variants "all native"
  done
  store_rows new ab_old new new
elif [ "${PART}" = s33d ]; then
  gpu_tests gpu_tests_s33d
  grep -E "^FAILED|^E " "$OUT/gpu_tests_s33d.log" | head -30 >> "$LOG"
  echo "=== tools/probe_cold_phases.py --rounds 40" >> "$LOG"
  timeout 120 python3 tools/probe_cold_phases.py --rounds 40 >> "$LOG" 2>&1
  for v in new ab_old; do
    use "$v"; echo "=== ($v code)" >> "$LOG"; tool_runs 1 probe_native_planner --rounds 40 --variants "all native"
  done
  store_rows new ab_old new
elif [ "${PART}" = s34a ]; then
  gpu_tests gpu_tests_s34a
  grep -E "^FAILED|^E " "$OUT/gpu_tests_s34a.log" | head -30 >> "$LOG"
  store_rows new new new
  echo "=== tools/probe_handoff.py --devices 0,0 --iters 150 --variants on" >> "$LOG"
  timeout 120 python3 tools/probe_handoff.py --devices 0,0 --iters 150 --variants on >> "$LOG" 2>&1
elif [ "${PART}" = s35a ]; then
  gpu_tests gpu_tests_s35a
  grep -E "^FAILED|^E " "$OUT/gpu_tests_s35a.log" | head -30 >> "$LOG"
  store_rows new new new
  echo "=== tools/probe_handoff.py --devices 0,0 --iters 150 --variants on" >> "$LOG"
  timeout 120 python3 tools/probe_handoff.py --devices 0,0 --iters 150 --variants on >> "$LOG" 2>&1
elif [ "${PART}" = s35b ]; then
  gpu_tests gpu_tests_s35b
  grep -E "^FAILED|^E " "$OUT/gpu_tests_s35b.log" | head -30 >> "$LOG"
  echo "=== tools/probe_handoff.py --devices 0,0 --iters 150 --variants on" >> "$LOG"
  timeout 120 python3 tools/probe_handoff.py --devices 0,0 --iters 150 --variants on >> "$LOG" 2>&1
elif [ "${PART}" = s35c ]; then
  for r in 1 2 3; do
    for v in base new; do
      use "$v"
      echo "=== round $r: $v: tools/probe_handoff.py --devices 0,0 --iters 100 --variants on" >> "$LOG"
      timeout 100 python3 tools/probe_handoff.py --devices 0,0 --iters 100 --variants on 2>&1 | tail -3 >> "$LOG"
    done
  done
  use new
elif [ "${PART}" = s35d ]; then
  gpu_tests gpu_tests_s35d
  grep -E "^FAILED|^E " "$OUT/gpu_tests_s35d.log" | head -30 >> "$LOG"
elif [ "${PART}" = s36a ]; then
  gpu_tests gpu_tests_s36a
  grep -E "^FAILED|^E " "$OUT/gpu_tests_s36a.log" | head -30 >> "$LOG"
  store_rows new new
  echo "=== tools/probe_handoff.py --devices 0,0 --iters 100 --variants on" >> "$LOG"
  timeout 90 python3 tools/probe_handoff.py --devices 0,0 --iters 100 --variants on 2>&1 | tail -4 >> "$LOG"
  echo "=== kvstrata.ops.calibrate(force=True): seconds" >> "$LOG"
  timeout 90 python3 -c "import time; from kvstrata.ops import calibrate; t = time.perf_counter(); calibrate(force=True); \
print(f'calibrate took {time.perf_counter() - t:.1f} s')" >> "$LOG" 2>&1
elif [ "${PART}" = s36b ]; then
  gpu_tests gpu_tests_s36b
  grep -E "^FAILED|^E " "$OUT/gpu_tests_s36b.log" | head -30 >> "$LOG"
elif [ "${PART}" = s37a ]; then
  gpu_tests gpu_tests_s37a
  grep -E "^FAILED|^E " "$OUT/gpu_tests_s37a.log" | head -30 >> "$LOG"
  store_rows new new new
  echo "=== tools/probe_handoff.py --devices 0,0 --iters 100 --variants on" >> "$LOG"
  timeout 90 python3 tools/probe_handoff.py --devices 0,0 --iters 100 --variants on 2>&1 | tail -4 >> "$LOG"
elif [ "${PART}" = s38a ]; then
  gpu_tests gpu_tests_s38a
  grep -E "^FAILED|^E " "$OUT/gpu_tests_s38a.log" | head -30 >> "$LOG"
  for v in ab_old new; do
    use "$v"
    echo "=== tools/probe_retired_pages.py ($v code)" >> "$LOG"
    timeout 120 python3 tools/probe_retired_pages.py --out "$OUT/retired_pages_$v.json" >> "$LOG" 2>&1
  done
  use new
  store_rows new
  echo "=== tools/probe_handoff.py --devices 0,0 --iters 100 --variants on" >> "$LOG"
  timeout 90 python3 tools/probe_handoff.py --devices 0,0 --iters 100 --variants on 2>&1 | tail -4 >> "$LOG"
elif [ "${PART}" = s38b ]; then
  gpu_tests gpu_tests_s38b
  grep -E "^FAILED|^E " "$OUT/gpu_tests_s38b.log" | head -30 >> "$LOG"
elif [ "${PART}" = s39 ] || [ "${PART}" = s39b ]; then
  if [ "${PART}" = s39 ]; then
    gpu_tests gpu_tests_s39
    grep -E "^FAILED|^E " "$OUT/gpu_tests_s39.log" | head -30 >> "$LOG"
  else
    timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ops_block_pack.py \
      tests/test_integrations_prefix_cache.py 2>&1 | tail -15 >> "$LOG"
  fi
  for blocks in 128 32; do
    echo "=== kvstrata bench prefix --blocks $blocks" >> "$LOG"
    timeout 240 python3 -m kvstrata.cli.main bench prefix --blocks "$blocks" --out "$OUT/prefix_$blocks" >> "$LOG" 2>&1
    echo "rc=$?" >> "$LOG"
    cp "$OUT/prefix_$blocks/prefix_cache.json" "$OUT/prefix_cache_b${blocks}_${PART}_h200.json" 2>/dev/null
    rm -rf "$OUT/prefix_$blocks"
  done
  echo "=== kvstrata demo --device cuda" >> "$LOG"
  timeout 120 python3 -m kvstrata.cli.main demo --device cuda >> "$LOG" 2>&1
  echo "rc=$?" >> "$LOG"
elif [ "${PART}" = s39c ]; then
  for blocks in 32 128; do
    echo "=== tools/probe_prefix_steps.py --blocks $blocks" >> "$LOG"
    timeout 120 python3 tools/probe_prefix_steps.py --blocks "$blocks" >> "$LOG" 2>&1
  done
  timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_ops_block_pack.py \
    tests/test_integrations_prefix_cache.py 2>&1 | tail -3 >> "$LOG"
  echo "=== kvstrata bench prefix --blocks 128" >> "$LOG"
  timeout 240 python3 -m kvstrata.cli.main bench prefix --blocks 128 --out "$OUT/p" >> "$LOG" 2>&1
  cp "$OUT/p/prefix_cache.json" "$OUT/prefix_cache_b128_s39c_h200.json" 2>/dev/null; rm -rf "$OUT/p"
elif [ "${PART}" = s40 ]; then
  timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_device_bytes.py \
    tests/test_integrations_checkpoint.py tests/test_ops_block_pack.py tests/test_integrations_prefix_cache.py \
    2>&1 | tail -8 >> "$LOG"
  echo "=== kvstrata bench checkpoint" >> "$LOG"
  timeout 240 python3 -m kvstrata.cli.main bench checkpoint --name checkpoint_gpu_s40_h200 --out "$OUT" >> "$LOG" 2>&1
  echo "=== kvstrata bench prefix --blocks 128" >> "$LOG"
  timeout 240 python3 -m kvstrata.cli.main bench prefix --blocks 128 --out "$OUT/p" >> "$LOG" 2>&1
  cp "$OUT/p/prefix_cache.json" "$OUT/prefix_cache_b128_s40_h200.json" 2>/dev/null; rm -rf "$OUT/p"
elif [ "${PART}" = s43 ]; then
  export PATH="$PWD/.etcdbin:$PATH" PYTHONPATH="$PWD/src:/tmp/site"
  gpu_tests gpu_tests_s43
  echo "=== pytest tests/cluster (CPU, etcd; the stale-write fencing's real-CUDA commit path among the GPU tests)" >> "$LOG"
  timeout 200 python3 -m pytest -q tests/cluster -p no:cacheprovider --timeout 120 > "$OUT/cluster_tests_s43.log" 2>&1
  tail -3 "$OUT/cluster_tests_s43.log" | tee -a "$LOG"
  for r in 1 2; do
    for v in ab_old new; do
      use "$v"
      echo "=== tools/probe_tcp_values.py ($v code, round $r)" >> "$LOG"
      timeout 60 python3 tools/probe_tcp_values.py --sizes-kib 4096,65536 --rounds 3 >> "$LOG" 2>&1
    done
  done
  use new
elif [ "${PART}" = s42c ]; then
  export PATH="$PWD/.etcdbin:$PATH" PYTHONPATH="$PWD/src:/tmp/site"
  gpu_tests gpu_tests_s42c
  echo "=== pytest tests/cluster tests/test_transport_auth.py (CPU, etcd)" >> "$LOG"
  timeout 240 python3 -m pytest -q tests/cluster tests/test_transport_auth.py -p no:cacheprovider --timeout 120 \
    > "$OUT/cluster_tests_s42c.log" 2>&1
  tail -3 "$OUT/cluster_tests_s42c.log" | tee -a "$LOG"
elif [ "${PART}" = s42b ]; then
  export PATH="$PWD/.etcdbin:$PATH"
  for r in 1 2; do
    for v in ab_old new; do
      use "$v"
      export PYTHONPATH="$PYTHONPATH:/tmp/site"
      echo "=== kvstrata bench cluster --join-bytes 1GiB ($v code, round $r)" >> "$LOG"
      timeout 120 python3 -m kvstrata.cli.main bench cluster --join-bytes 1GiB --sizes 256KiB --seconds 0.3 \
        --name "cluster_join_s42b_${v}_$r" --out "$OUT" 2>&1 | grep -v WARNING | grep "join:" >> "$LOG"
    done
  done
  use new
elif [ "${PART}" = s42 ]; then
  export PATH="$PWD/.etcdbin:$PATH" PYTHONPATH="$PWD/src:/tmp/site"  # (the carried wheels' --target)
  { etcd --version | sed -n 1p; python3 -c "import etcd3gw; print('etcd3gw', etcd3gw.__file__)"; } >> "$LOG" 2>&1
  gpu_tests gpu_tests_s42
  echo "=== pytest tests/cluster (CPU, etcd)" >> "$LOG"
  timeout 240 python3 -m pytest -q tests/cluster -p no:cacheprovider --timeout 120 > "$OUT/cluster_tests_s42.log" 2>&1
  tail -3 "$OUT/cluster_tests_s42.log" | tee -a "$LOG"
  for r in 1 2; do
    echo "=== kvstrata bench cluster --join-bytes 1GiB (round $r)" >> "$LOG"
    timeout 150 python3 -m kvstrata.cli.main bench cluster --join-bytes 1GiB --name "cluster_s42_h200host_$r" \
      --out "$OUT" >> "$LOG" 2>&1
  done
elif [ "${PART}" = s41b ]; then
  gpu_tests gpu_tests_s41b
  for r in 1 2; do
    for v in ab_old new; do
      use "$v"
      echo "=== tools/probe_tcp_values.py ($v code, round $r)" >> "$LOG"
      timeout 100 python3 tools/probe_tcp_values.py --sizes-kib 256,4096,65536 --rounds 3 >> "$LOG" 2>&1
    done
  done
  use new
elif [ "${PART}" = s41 ]; then
  gpu_tests gpu_tests_s41
  echo "=== kvstrata bench checkpoint" >> "$LOG"
  timeout 150 python3 -m kvstrata.cli.main bench checkpoint --name checkpoint_gpu_s41_h200 --out "$OUT" >> "$LOG" 2>&1
  echo "=== kvstrata bench prefix --blocks 128" >> "$LOG"
  timeout 120 python3 -m kvstrata.cli.main bench prefix --blocks 128 --out "$OUT/p" >> "$LOG" 2>&1
  cp "$OUT/p/prefix_cache.json" "$OUT/prefix_cache_b128_s41_h200.json" 2>/dev/null; rm -rf "$OUT/p"
elif [ "${PART}" = s24e ]; then
  tool_runs 2 probe_kept_quiet --rounds 150
elif [ "${PART}" = s24d ]; then
  for t in probe_kept_after:--calls:60 probe_store_ab:--iters:20 trace_store_device; do
    IFS=: read -r name flag val <<< "$t"
    echo "=== tools/${name}.py ${flag:-} ${val:-} (on tools/_copy_trace.kept_client)" >> "$LOG"
    timeout 150 python3 "tools/${name}.py" ${flag:+"$flag" "$val"} >> "$LOG" 2>&1
    echo "rc=$?" >> "$LOG"
  done
elif [ "${PART}" = s24c ]; then
  gpu_tests gpu_tests_s24c
  echo "=== the docstrings' examples (pytest --doctest-modules src/kvstrata)" >> "$LOG"
  timeout 120 python3 -m pytest -q -p no:cacheprovider src/kvstrata 2>&1 | tail -3 >> "$LOG"
  store_rows new new
elif [ "${PART}" = s24b ]; then
  gpu_tests gpu_tests_s24b
  for v in default off off default; do
    if [ "$v" = off ]; then export KVSTRATA_SPIN_US=0; else unset KVSTRATA_SPIN_US; fi
    echo "=== (the worker's busy-polls: $v)" >> "$LOG"
    bench 60 store --no-redis --no-mooncake --sizes 1MiB --clients 1
  done
  unset KVSTRATA_SPIN_US
elif [ "${PART}" = s24a ]; then
  gpu_tests gpu_tests_s24a
  store_rows new new
  echo "=== tools/probe_handoff.py --devices 0,0 --iters 150 --variants on" >> "$LOG"
  timeout 150 python3 tools/probe_handoff.py --devices 0,0 --iters 150 --variants on >> "$LOG" 2>&1
elif [ "${PART}" = s23g ]; then
  for t in probe_kept_split:--calls probe_kept_tail:--rounds probe_batch_growth:--rounds; do
    echo "=== tools/${t%%:*}.py (on tools/_copy_trace.py)" >> "$LOG"
    timeout 90 python3 "tools/${t%%:*}.py" "${t#*:}" 20 >> "$LOG" 2>&1
  done
elif [ "${PART}" = s23f ]; then
  gpu_tests gpu_tests_s23f
  store_rows new ab_head new
  echo "=== tools/probe_kept_split.py" >> "$LOG"
  timeout 120 python3 tools/probe_kept_split.py --calls 60 >> "$LOG" 2>&1
elif [ "${PART}" = s23e ]; then
  gpu_tests gpu_tests_s23e
  for r in 1 2; do
    echo "=== tools/probe_kept_tail.py (round $r)" >> "$LOG"
    timeout 120 python3 tools/probe_kept_tail.py --rounds 120 >> "$LOG" 2>&1
  done
  echo "=== tools/probe_kept_split.py" >> "$LOG"
  timeout 120 python3 tools/probe_kept_split.py --calls 60 >> "$LOG" 2>&1
  store_rows new new
elif [ "${PART}" = s23d ]; then
  gpu_tests gpu_tests_s23d
  for r in 1 2 3; do
    echo "=== tools/probe_batch_growth.py (round $r)" >> "$LOG"
    timeout 150 python3 tools/probe_batch_growth.py --rounds 60 >> "$LOG" 2>&1
  done
  store_rows new new
elif [ "${PART}" = s23c ]; then
  for r in 1 2 3; do
    echo "=== tools/probe_kept_ab.py (round $r)" >> "$LOG"
    timeout 150 python3 tools/probe_kept_ab.py --rounds 150 >> "$LOG" 2>&1
  done
elif [ "${PART}" = s23b ]; then
  gpu_tests gpu_tests_s23b
  for v in ab_head new new ab_head ab_head new; do
    use "$v"; echo "=== tools/probe_kept_split.py ($v code)" >> "$LOG"
    timeout 120 python3 tools/probe_kept_split.py --calls 60 >> "$LOG" 2>&1
  done
  use new
  store_rows ab_head new new ab_head ab_head new
elif [ "${PART}" = s23a ]; then
  gpu_tests gpu_tests_s23a
  for v in new ab_head ab_head new; do
    use "$v"; echo "=== tools/probe_kept_split.py ($v code)" >> "$LOG"
    timeout 120 python3 tools/probe_kept_split.py --calls 60 >> "$LOG" 2>&1
  done
  use new
  store_rows new ab_head ab_head new
elif [ "${PART}" = s22j ]; then
  store_rows new ab_head ab_head new new ab_head ab_head new
  gpu_tests gpu_tests_s22j
elif [ "${PART}" = s22i ]; then
  store_rows new ab_head ab_head new new ab_head ab_head new
elif [ "${PART}" = s22h ]; then
  gpu_tests gpu_tests_s22h
  store_rows ab_head new new ab_head ab_head new
  echo "=== tools/probe_kept_split.py (new code)" >> "$LOG"
  timeout 90 python3 tools/probe_kept_split.py --calls 100 >> "$LOG" 2>&1
elif [ "${PART}" = s22g ]; then
  store_rows ab_mid new new ab_mid ab_mid new
elif [ "${PART}" = s22f ]; then
  for r in 1 2 3; do
    for v in new ab_first4; do
      grep '^cpu' /proc/stat | awk '{print "steal before", $1, $9}' | tr '\n' ' ' >> "$LOG"; echo >> "$LOG"
      store_rows "$v"
      grep '^cpu' /proc/stat | awk '{print "steal after", $1, $9}' | tr '\n' ' ' >> "$LOG"; echo >> "$LOG"
    done
  done
elif [ "${PART}" = s22e ]; then
  gpu_tests gpu_tests_s22e
  store_rows ab_old new new ab_old ab_old new
  for r in 1 2; do
    for v in ab_old new; do
      use "$v"
      echo "=== tools/probe_kept_split.py ($v code, round $r)" >> "$LOG"
      timeout 90 python3 tools/probe_kept_split.py --calls 100 >> "$LOG" 2>&1
    done
  done
  use new
elif [ "${PART}" = s22d ]; then
  for idle in 1 0.1; do
    echo "=== tools/probe_first_batch.py --idle-ms $idle" >> "$LOG"
    timeout 60 python3 tools/probe_first_batch.py --idle-ms "$idle" >> "$LOG" 2>&1
  done
  echo "=== tools/probe_copy_calls.py" >> "$LOG"; timeout 60 python3 tools/probe_copy_calls.py >> "$LOG" 2>&1
elif [ "${PART}" = s22c ]; then
  for r in 1 2; do
    echo "=== tools/probe_first_copy.py --iters 100 (round $r)" >> "$LOG"
    timeout 120 python3 tools/probe_first_copy.py --iters 100 >> "$LOG" 2>&1
    python3 -c "from kvstrata.bench._common import python_loop_us as f; print('python_loop_us', f())" >> "$LOG" 2>&1
  done
elif [ "${PART}" = s22b ]; then
  for r in 1 2 3; do
    for v in ab_old new; do
      use "$v"
      echo "=== tools/probe_kept_split.py ($v code, round $r)" >> "$LOG"
      PYTHONPATH="$PYTHONPATH:$PWD/src" timeout 90 python3 tools/probe_kept_split.py --calls 100 >> "$LOG" 2>&1
    done
  done
  use new
elif [ "${PART}" = s22a ]; then
  KVSTRATA_TEST_WAIT=20 timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 120 \
    tests/test_client_device.py tests/test_kept_reads.py tests/test_local_reads.py tests/test_landing.py > "$OUT/gpu_tests_s22a.log" 2>&1
  tail -3 "$OUT/gpu_tests_s22a.log" | tee -a "$LOG"
  store_rows ab_old new new ab_old ab_old new
elif [ "${PART}" = s21k ]; then
  gpu_tests gpu_tests_s21k
elif [ "${PART}" = s21j ]; then
  bench 90 store --no-redis --no-mooncake --sizes 1MiB --clients 1
elif [ "${PART}" = s21i ]; then
  lscpu >> "$LOG" 2>&1
  echo "=== tools/probe_smt.py" >> "$LOG"; timeout 60 python3 tools/probe_smt.py >> "$LOG" 2>&1
  echo "=== tools/probe_kept_after.py" >> "$LOG"; timeout 120 python3 tools/probe_kept_after.py >> "$LOG" 2>&1
elif [ "${PART}" = s21h ]; then
  for r in 1 2 3 4 5 6; do
    for v in ab_old new; do
      use "$v"
      echo "=== ($v code, round $r)" >> "$LOG"
      CUDA_VISIBLE_DEVICES= bench 60 store --no-redis --no-mooncake --sizes 4KiB --clients 1
    done
  done
  use new
elif [ "${PART}" = s21g ]; then
  for r in 1 2 3 4; do
    for v in ab_old new; do
      use "$v"
      echo "=== tools/probe_set_get.py ($v code, round $r)" >> "$LOG"
      timeout 60 python3 tools/probe_set_get.py --rounds 2 >> "$LOG" 2>&1
    done
  done
  for v in new ab_old; do
    use "$v"
    echo "=== ($v code)" >> "$LOG"; bench 90 store --no-redis --no-mooncake --sizes 4KiB --clients 1
  done
  use new
elif [ "${PART}" = s21f ]; then
  gpu_tests gpu_tests_s21f
  store_twice
  echo "=== tools/probe_copy_calls.py" >> "$LOG"; timeout 90 python3 tools/probe_copy_calls.py >> "$LOG" 2>&1
  for v in ab_old new new ab_old; do
    use "$v"
    echo "=== ($v code)" >> "$LOG"; bench 90 store --no-redis --no-mooncake --sizes 4KiB --clients 1
    cp "$OUT/store.json" "$OUT/store_4k_$v.json"
  done
  use new
elif [ "${PART}" = s21e ]; then
  KVSTRATA_TEST_WAIT=20 timeout 150 python3 -m pytest -q -m "gpu or multigpu" -p no:cacheprovider --timeout 60 \
    tests/test_client_device.py tests/test_local_reads.py tests/test_reservations.py tests/test_landing.py 2>&1 \
    | tail -3 | tee -a "$LOG"
  for r in 1 2; do
    for v in ab_mid new; do
      use "$v"
      echo "=== tools/probe_first_copy.py --iters 100 ($v code, round $r)" >> "$LOG"
      timeout 90 python3 tools/probe_first_copy.py --iters 100 2>&1 | grep -v check_key >> "$LOG"
    done
  done
  use new
  store_rows ab_mid new new ab_mid ab_mid new
elif [ "${PART}" = s21d ]; then
  gpu_tests gpu_tests_s21d
  store_twice
  echo "=== tools/probe_first_copy.py --iters 100" >> "$LOG"
  timeout 90 python3 tools/probe_first_copy.py --iters 100 2>&1 | grep -v check_key >> "$LOG"
elif [ "${PART}" = s21c ]; then
  for r in 1 2; do
    echo "=== tools/probe_commit_ahead.py --calls 150 (round $r)" >> "$LOG"
    timeout 120 python3 tools/probe_commit_ahead.py --calls 150 >> "$LOG" 2>&1
  done
  store_rows new ab_old ab_old new
elif [ "${PART}" = s21b ]; then
  KVSTRATA_TEST_WAIT=20 timeout 150 python3 -m pytest -q -m "gpu or multigpu" -p no:cacheprovider --timeout 60 \
    tests/test_client_device.py tests/test_reservations.py tests/test_landing.py 2>&1 | tail -3 | tee -a "$LOG"
  store_rows ab_old new new ab_old ab_old new
  for c in 0 3; do
    echo "=== tools/probe_first_copy.py --iters 100 --commit-ahead $c" >> "$LOG"
    timeout 90 python3 tools/probe_first_copy.py --iters 100 --commit-ahead $c 2>&1 | grep -v check_key >> "$LOG"  # 4804a1e
  done
elif [ "${PART}" = s21a ]; then
  echo "=== tools/probe_copy_calls.py" >> "$LOG"; timeout 90 python3 tools/probe_copy_calls.py >> "$LOG" 2>&1
  echo "=== tools/probe_first_copy.py" >> "$LOG"; timeout 120 python3 tools/probe_first_copy.py >> "$LOG" 2>&1
  store_traces new
elif [ "${PART}" = s20f ]; then
  gpu_tests gpu_tests_s20f
  store_twice
elif [ "${PART}" = s20e ]; then
  KVSTRATA_TEST_WAIT=20 timeout 150 python3 -m pytest -q -m "gpu or multigpu" -p no:cacheprovider --timeout 60 \
    tests/test_client_device.py tests/test_reservations.py tests/test_landing.py 2>&1 | tail -3 | tee -a "$LOG"
  store_rows ab_mid new new ab_mid ab_mid new
  echo "=== tools/probe_async_calls.py --iters 8 --tail (new code)" >> "$LOG"
  timeout 60 python3 tools/probe_async_calls.py --iters 8 --tail >> "$LOG" 2>&1
elif [ "${PART}" = s20d ]; then
  gpu_tests gpu_tests_s20d
  store_twice
elif [ "${PART}" = s20c ]; then
  store_rows ab_old new new ab_old ab_old new
  echo "=== tools/probe_async_calls.py --iters 8 --tail (new code)" >> "$LOG"
  timeout 60 python3 tools/probe_async_calls.py --iters 8 --tail >> "$LOG" 2>&1
elif [ "${PART}" = s20b ]; then
  store_rows ab_old new ab_old new
  echo "=== tools/probe_async_calls.py --iters 8 --tail (new code)" >> "$LOG"
  timeout 60 python3 tools/probe_async_calls.py --iters 8 --tail >> "$LOG" 2>&1
elif [ "${PART}" = s20a ]; then
  gpu_tests gpu_tests_s20a
  store_rows ab_old new ab_old new
  echo "=== tools/probe_async_calls.py --iters 8 (new code)" >> "$LOG"
  timeout 60 python3 tools/probe_async_calls.py --iters 8 >> "$LOG" 2>&1
elif [ "${PART}" = s19w ]; then
  gpu_tests gpu_tests_s19w
elif [ "${PART}" = s19x ]; then
  for b in none request none; do
    echo "=== tools/probe_store_ops.py --before $b" >> "$LOG"
    timeout 90 python3 tools/probe_store_ops.py --before $b >> "$LOG" 2>&1
  done
  bench 60 store --no-redis --no-mooncake --sizes 1MiB --clients 1
elif [ "${PART}" = s19y ]; then
  for r in 1 2; do
    for b in none sleep request; do
      echo "=== tools/probe_store_ops.py --before $b (round $r)" >> "$LOG"
      timeout 90 python3 tools/probe_store_ops.py --before $b >> "$LOG" 2>&1
    done
  done
elif [ "${PART}" = s18a ]; then
  nproc >> "$LOG"
  echo "=== tools/probe_handoff_floor.py --devices ${DEVS} --iters 100" >> "$LOG"
  timeout 120 python3 tools/probe_handoff_floor.py --devices "${DEVS}" --iters 100 2>&1 | grep -v Producer >> "$LOG"
  echo "=== tools/probe_handoff.py --devices ${DEVS} --iters 120 --trace" >> "$LOG"
  timeout 150 python3 tools/probe_handoff.py --devices "${DEVS}" --iters 120 --trace 2>&1 | grep -v Producer >> "$LOG"
  echo "=== tools/probe_handoff_steps.py" >> "$LOG"
  timeout 120 python3 tools/probe_handoff_steps.py >> "$LOG" 2>&1
  store_twice
elif [ "${PART}" = s18b ]; then
  nproc >> "$LOG"
  echo "=== tools/probe_handoff.py --devices ${DEVS} --iters 100 --variants on,owarm,rhot,hot --trace" >> "$LOG"
  timeout 200 python3 tools/probe_handoff.py --devices "${DEVS}" --iters 100 --variants on,owarm,rhot,hot --trace 2>&1 \
    | grep -v Producer >> "$LOG"
  for r in 1 2; do
    echo "=== tools/trace_store_device.py (round $r)" >> "$LOG"; timeout 60 python3 tools/trace_store_device.py >> "$LOG" 2>&1
    bench 60 store --no-redis --no-mooncake --sizes 1MiB --clients 1; cp "$OUT/store.json" "$OUT/store_$r.json"
  done
elif [ "${PART}" = s18c ]; then
  nproc >> "$LOG"
  cspin="KVSTRATA_DEVOBJ_SPIN_US=0 KVSTRATA_DEVOBJ_LEAD_SPIN_US=0 KVSTRATA_DEVOBJ_RESULT_SPIN_US=0"
  for r in 1 2; do
    for v in default "KVSTRATA_SPIN_US=0" "$cspin" "KVSTRATA_SPIN_US=0 $cspin"; do
      echo "=== tools/probe_handoff.py --devices ${DEVS} --iters 60 --trace, spins: $v (round $r)" >> "$LOG"
      # shellcheck disable=SC2086
      env $( [ "$v" = default ] || echo $v ) timeout 120 python3 tools/probe_handoff.py --devices "${DEVS}" --iters 60 \
        --trace 2>&1 | grep -v Producer | grep -v "worker:\|kvstrata-devobj-poll" >> "$LOG"
    done
  done
elif [ "${PART}" = s18z ]; then
  gpu_tests gpu_tests_s18z
  store_twice
  echo "=== tools/trace_store_device.py" >> "$LOG"; timeout 60 python3 tools/trace_store_device.py >> "$LOG" 2>&1
elif [ "${PART}" = s18y ]; then
  store_ab ab_old
  store_traces ab_old new
elif [ "${PART}" = s18x ]; then
  store_rows new ab_old ab_old new
  store_traces new ab_old
elif [ "${PART}" = s18w ]; then
  for v in ab_old new ab_old new; do
    use "$v"; echo "=== tools/probe_store_ops.py ($v code)" >> "$LOG"; timeout 90 python3 tools/probe_store_ops.py >> "$LOG" 2>&1
  done
  use new
elif [ "${PART}" = s18v ]; then
  use ab_diag
  for r in 1 2; do
    echo "=== tools/probe_handoff.py --devices ${DEVS} --iters 100 --variants on (ab_diag code, round $r)" >> "$LOG"
    timeout 120 python3 tools/probe_handoff.py --devices "${DEVS}" --iters 100 --variants on 2>&1 | grep -v Producer >> "$LOG"
  done
  use new
elif [ "${PART}" = s18u ]; then
  store_rows ab_old new new ab_old ab_old new new ab_old
elif [ "${PART}" = s18t ]; then
  for t in 2 1 1 2 2 1 1 2; do
    export KVSTRATA_ASYNC_MSET_THREADS=$t; echo "=== (async_mset_d2h threads: $t)" >> "$LOG"
    bench 60 store --no-redis --no-mooncake --sizes 1MiB --clients 1
  done
  unset KVSTRATA_ASYNC_MSET_THREADS
elif [ "${PART}" = s18s ]; then
  for r in 1 2; do
    echo "=== tools/probe_async_calls.py --iters 8 (round $r)" >> "$LOG"
    timeout 120 python3 tools/probe_async_calls.py --iters 8 >> "$LOG" 2>&1
    [ "$r" = 1 ] && store_traces new
  done
elif [ "${PART}" = s18r ]; then
  for r in 1 2; do
    echo "=== tools/probe_async_calls.py --iters 6 --tail (round $r)" >> "$LOG"
    timeout 120 python3 tools/probe_async_calls.py --iters 6 --tail >> "$LOG" 2>&1
  done
elif [ "${PART}" = s12z ]; then
  gpu_tests gpu_tests_final
  for d in 0,1 0,0; do
    echo "=== tools/probe_handoff.py --devices $d --iters 150" >> "$LOG"
    timeout 120 python3 tools/probe_handoff.py --devices $d --iters 150 2>&1 | grep -v Producer >> "$LOG"
  done
  bench 150 device --quick --broadcast-gib 8 --wait 30
elif [ "${PART}" = s12a ] || [ "${PART}" = s12b ] || [ "${PART}" = s12y ]; then
  KVSTRATA_TEST_WAIT=20 timeout 200 python3 -m pytest -q -m "gpu or multigpu" -p no:cacheprovider --timeout 60 \
    tests/test_devobj_*.py > "$OUT/gpu_tests_devobj.log" 2>&1
  tail -3 "$OUT/gpu_tests_devobj.log" | tee -a "$LOG"
  for d in 0,1 0,0; do
    echo "=== tools/probe_handoff.py --devices $d --iters 120 --trace" >> "$LOG"
    timeout 120 python3 tools/probe_handoff.py --devices $d --iters 120 --trace 2>&1 | grep -v Producer >> "$LOG"
  done
  [ "${PART}" = s12a ] && bench 150 device --quick --wait 30
  [ "${PART}" = s12y ] && bench 150 device --quick --broadcast-gib 8 --wait 30
elif [ "${PART}" = s11z ]; then
  gpu_tests gpu_tests_final
  echo "=== tools/probe_handoff.py --devices 0,1 --iters 150" >> "$LOG"
  timeout 120 python3 tools/probe_handoff.py --devices 0,1 --iters 150 >> "$LOG" 2>&1
  bench 150 device --quick --broadcast-gib 8 --wait 30
  store_twice
elif [ "${PART}" = s11e ]; then
  KVSTRATA_TEST_WAIT=20 timeout 200 python3 -m pytest -q -m "gpu or multigpu" -p no:cacheprovider --timeout 60 \
    tests/test_devobj_*.py 2>&1 | tail -3 | tee -a "$LOG"
  for d in 0,1 0,0; do
    echo "=== tools/probe_handoff.py --devices $d --iters 150" >> "$LOG"
    timeout 120 python3 tools/probe_handoff.py --devices $d --iters 150 >> "$LOG" 2>&1
  done
  bench 150 device --quick --wait 30
elif [ "${PART}" = s11f ]; then
  KVSTRATA_TEST_WAIT=20 timeout 200 python3 -m pytest -q -m "gpu or multigpu" -p no:cacheprovider --timeout 60 \
    tests/test_devobj_*.py 2>&1 | tail -3 | tee -a "$LOG"
  bench 150 device --quick --broadcast-gib 8 --wait 30
elif [ "${PART}" = s10y ]; then
  KVSTRATA_TEST_WAIT=20 timeout 150 python3 -m pytest -q -m "gpu or multigpu" -p no:cacheprovider --timeout 60 \
    tests/store tests/test_client_device.py tests/test_acquire_batches.py tests/test_landing.py \
    tests/test_reservations.py tests/test_bench_store.py 2>&1 | tail -3 | tee -a "$LOG"
  store_twice
  echo "=== tools/probe_cold_ab.py --iters 100" >> "$LOG"; timeout 120 python3 tools/probe_cold_ab.py --iters 100 >> "$LOG" 2>&1
  echo "=== tools/probe_mset_tail.py --calls 30" >> "$LOG"; timeout 90 python3 tools/probe_mset_tail.py --calls 30 >> "$LOG" 2>&1
elif [ "${PART}" = s9e ]; then
  KVSTRATA_TEST_WAIT=20 timeout 120 python3 -m pytest -q -m "gpu or multigpu" -p no:cacheprovider --timeout 60 \
    tests/test_client_device.py tests/test_acquire_batches.py tests/test_landing.py 2>&1 | tail -3 | tee -a "$LOG"
  for v in new off new off; do
    if [ "$v" = off ]; then export KVSTRATA_PLACEMENT_TABLE=0; else unset KVSTRATA_PLACEMENT_TABLE; fi
    echo "=== ($v: placement table)" >> "$LOG"; bench 60 store --no-redis --no-mooncake --sizes 1MiB --clients 1
    echo "=== tools/trace_store_device.py ($v: placement table)" >> "$LOG"
    timeout 40 python3 tools/trace_store_device.py >> "$LOG" 2>&1
  done
  unset KVSTRATA_PLACEMENT_TABLE
elif [ "${PART}" = s8z ]; then
  KVSTRATA_TEST_WAIT=20 timeout 250 python3 -m pytest -q -m "gpu or multigpu" -p no:cacheprovider --timeout 120 \
    > "$OUT/gpu_tests_final.log" 2>&1
  tail -3 "$OUT/gpu_tests_final.log" | tee -a "$LOG"
  bench 120 device --quick --broadcast-gib 8 --wait 30
  store_twice
  echo "=== tools/trace_store_device.py" >> "$LOG"; timeout 40 python3 tools/trace_store_device.py >> "$LOG" 2>&1
  bench 60 gather --quick
  echo "=== tools/probe_gather_floor.py" >> "$LOG"; timeout 90 python3 tools/probe_gather_floor.py >> "$LOG" 2>&1
elif [ "${PART}" = s8e ]; then
  for d in 0 5000; do
    echo "=== KVSTRATA_DOZE_US=$d" >> "$LOG"
    KVSTRATA_DOZE_US=$d bench 90 device --quick --broadcast-gib 2 --wait 30
    KVSTRATA_DOZE_US=$d timeout 60 python3 tools/devobj_latency_cpu.py --iters 400 >> "$LOG" 2>&1
  done
elif [ "${PART}" = s7z ]; then
  KVSTRATA_TEST_WAIT=20 timeout 250 python3 -m pytest -q -m "gpu or multigpu" -p no:cacheprovider --timeout 120 \
    > "$OUT/gpu_tests_final.log" 2>&1
  tail -3 "$OUT/gpu_tests_final.log" | tee -a "$LOG"
  echo "=== tools/probe_store_ab.py --iters 100" >> "$LOG"; timeout 90 python3 tools/probe_store_ab.py --iters 100 >> "$LOG" 2>&1
  store_twice
  echo "=== tools/trace_store_device.py" >> "$LOG"; timeout 40 python3 tools/trace_store_device.py >> "$LOG" 2>&1
elif [ "${PART}" = s6a ]; then
  timeout 90 python3 -m pytest -q -m "gpu or multigpu" -p no:cacheprovider tests/test_client_device.py \
    tests/test_client_api.py 2>&1 | tail -3 | tee -a "$LOG"
  echo "=== tools/probe_request_ids.py" >> "$LOG"; timeout 150 python3 tools/probe_request_ids.py >> "$LOG" 2>&1
  store_ab ab_old
elif [ "${PART}" = s6b ]; then
  KVSTRATA_TEST_WAIT=20 timeout 280 python3 -m pytest -q -m "gpu or multigpu" -p no:cacheprovider --timeout 120 \
    > "$OUT/gpu_tests.log" 2>&1
  tail -15 "$OUT/gpu_tests.log"
  store_ab ab_old
  echo "=== tools/trace_store_device.py" >> "$LOG"; timeout 60 python3 tools/trace_store_device.py >> "$LOG" 2>&1
  bench 100 device --quick --wait 30
elif [ "${PART}" = s6f ]; then
  KVSTRATA_TEST_WAIT=20 timeout 280 python3 -m pytest -q -m "gpu or multigpu" -p no:cacheprovider --timeout 120 \
    > "$OUT/gpu_tests.log" 2>&1
  tail -15 "$OUT/gpu_tests.log"
  store_ab ab_prev
  cp "$OUT/store.json" "$OUT/store_device.json"
  echo "=== tools/trace_store_device.py" >> "$LOG"; timeout 60 python3 tools/trace_store_device.py >> "$LOG" 2>&1
  bench 120 device --quick --broadcast-gib 8 --wait 30
  bench 60 gather --quick
  bench 120 transfer --layers 32 --chunks-kib 16
elif [ "${PART}" = s6end ]; then
  KVSTRATA_TEST_WAIT=20 timeout 240 python3 -m pytest -q -m "gpu or multigpu" -p no:cacheprovider --timeout 120 \
    tests/test_client_device.py tests/test_reservations.py tests/test_client_api.py tests/test_devobj_gpu.py \
    tests/test_devobj_latency.py tests/test_devobj_stages.py > "$OUT/gpu_tests_end.log" 2>&1
  tail -3 "$OUT/gpu_tests_end.log" | tee -a "$LOG"
  echo "=== tools/probe_store_ab.py --iters 200" >> "$LOG"; timeout 90 python3 tools/probe_store_ab.py --iters 200 >> "$LOG" 2>&1
  store_twice
  echo "=== tools/trace_store_device.py" >> "$LOG"; timeout 60 python3 tools/trace_store_device.py >> "$LOG" 2>&1
elif [ "${PART}" = s6z ]; then
  timeout 90 python3 -m pytest -q -m "gpu or multigpu" -p no:cacheprovider tests/test_client_device.py \
    tests/test_reservations.py tests/test_client_api.py 2>&1 | tail -3 | tee -a "$LOG"
  store_twice
  echo "=== tools/trace_store_device.py" >> "$LOG"; timeout 60 python3 tools/trace_store_device.py >> "$LOG" 2>&1
elif [ "${PART}" = s6v ]; then
  timeout 90 python3 -m pytest -q -m "gpu or multigpu" -p no:cacheprovider tests/test_client_device.py \
    tests/test_reservations.py tests/test_client_api.py 2>&1 | tail -3 | tee -a "$LOG"
  store_ab ab_old
  cp "$OUT/store.json" "$OUT/store_device.json"
  echo "=== tools/trace_store_device.py" >> "$LOG"; timeout 60 python3 tools/trace_store_device.py >> "$LOG" 2>&1
else
  timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_ops_transfer_plan.py -m gpu 2>&1 | tail -3 | tee -a "$LOG"
  bench 80 device --quick --broadcast-wait both --wait 30
  bench 270 transfer
  bench 150 allgather
fi
grep -E "^===|^rc=|target|results:" "$LOG" | tail -40
ls "$OUT"
