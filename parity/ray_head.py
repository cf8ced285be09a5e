"""Keep one local Ray cluster up for several jobs (run_verification_main.sh): Ray start-up is a large
part of a CPU run, so the three training scripts share it. Writes the cluster's address to
--address_file and runs until SIGTERM/SIGINT; the cluster goes down with this process and only it,
unlike `ray stop`, which would stop every Ray cluster on the machine."""

import argparse
import signal
import sys
import time


def main() -> None:
    import ray

    from parity.atomic import write_text_atomic
    from parity.launch import ensure_ray

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--address_file", required=True)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    ensure_ray()
    # Published as a loopback address: the jobs then know the cluster is on this machine (parity.launch).
    port = ray.get_runtime_context().gcs_address.rsplit(":", 1)[1]
    write_text_atomic(args.address_file, f"127.0.0.1:{port}\n")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
