"""The distributed runtime: the one seam to DeepSpeed and torch.distributed (``dist``), DeepSpeed's
workarounds (``deepspeed_patches``), multi-node jobs (``multinode``), weights out of ZeRO-3 partitions
(``weights``) and a rank's faults (``resilience``)."""
