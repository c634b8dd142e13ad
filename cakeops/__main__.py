"""``python -m cakeops {bench,...}``: the library's command-line jobs."""
import argparse
import sys


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m cakeops", description=__doc__)
    parser.add_argument("command", choices=["bench", "demo"],
                        help="bench: time every op against its peers on this device ('bench model': a decoder's "
                             "training step, plain residual vs mHC); "
                             "demo: train a small mHC language model under torch.compile")
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    args = parser.parse_args(argv[:1])
    if args.command == "bench":
        from .bench.cli import main as bench_main
        return bench_main(argv[1:]) or 0
    if args.command == "demo":
        from .demo import main as demo_main
        return demo_main(argv[1:]) or 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
