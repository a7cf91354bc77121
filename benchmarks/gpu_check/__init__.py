"""The prepared GPU check: one command that one machine with one NVIDIA GPU runs in under 9 minutes.

    make gpu-check        # or: python -m benchmarks.gpu_check [--only 1,4] [--verbose]

Sections (each independent, with a time budget; a failing one prints FAIL with the first line of its error
and the others still run), then one summary line:

  1. numerics      the debug model's loss and gradients on CUDA (fp32, bf16) against CPU fp32; grouped-GEMM
                   experts (`torch._grouped_mm`) against the per-expert loop            (numerics.py)
  2. overhead      MoEvement's snapshots issued on a side stream with device checksums, read back, also as
                   a replayed CUDA graph; stall per iteration; overhead against `none` over interleaved
                   runs, and of snapshots on against off in alternating blocks of one run, call by call
                   and graphed                                                           (overhead.py)
  3. recovery      a crash and torchrun restart on CUDA ending with the fault-free digest (recovery.py)
  4. throughput    forward+backward of a DeepSeek-MoE-16B-shaped stage in bf16: tokens/s, MFU (throughput.py)
  5. shared GPU    two processes on the GPU run the trainer's control-tensor collectives (shared_gpu.py)
  6. replacement   two processes on the GPU run train.py at pp=2, rank 1 SIGKILLed and replaced in place by
                   its rank shell's standby, ending with the fault-free digest; SKIP with the reason while
                   the trainer cannot put two ranks on one GPU                             (replacement.py)
  7. GIL profile   py-spy --gil over one section-2 run: no thread but the training thread holds the GIL for
                   snapshot work; the training thread's snapshot share; SKIP without py-spy (gil_profile.py)

A section that knows it cannot run says SKIP and why (not a failure). Without CUDA the check says so in one
line and exits 0.

On a lent GPU machine `bash benchmarks/gpu_check/on_device.sh` is the one call: the carried wheels, these
sections and `stage_snapshot.py` (a 16B-shaped stage's snapshots at Algorithm 1's W), each part within its
budget, the log under $OUT.
"""
