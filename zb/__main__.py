"""`python -m zb ...`, so that `torchrun --nproc_per_node N -m zb train ...` launches local ranks."""

from zb.cli import main

if __name__ == "__main__":
    main()
