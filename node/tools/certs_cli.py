"""`tahnode certs`: make (on first use) and show the TLS certificate a coordinator (in its --store)
or a node (in its --checkpoint-dir) serves with, and the coordinator certificate a node trusts."""

from __future__ import annotations


def add_certs_command(sub) -> None:
    ce = sub.add_parser("certs", help="make (on first use) and show a TLS certificate: the coordinator's or a node's",
                        description="Show the TLS certificate a coordinator (in its --store) or a node (in its "
                        "--checkpoint-dir) serves with, making it first if there is none yet. Volunteers pin the "
                        "coordinator's with `tahnode join --coordinator-fingerprint FINGERPRINT`.")
    ce.add_argument("--dir", default="tahnode-store", help="the coordinator's --store or a node's --checkpoint-dir "
                    "(default tahnode-store)")
    ce.add_argument("--json", action="store_true", help="print one JSON object")


def run_certs(args) -> int:
    import json
    from pathlib import Path

    from ..net.identity import KEY_FILE
    from ..net.tls import CERT_FILE, PINNED_COORDINATOR_FILE, TlsCertificate, fingerprint

    folder = Path(args.dir)
    made = not (folder / CERT_FILE).exists()
    cert = TlsCertificate.load_or_create(folder)
    pinned = folder / PINNED_COORDINATOR_FILE
    info = {"certificate": str(folder / CERT_FILE), "fingerprint": cert.fingerprint, "made": made,
            "trusted_coordinator": fingerprint(pinned.read_bytes()) if pinned.exists() else None}
    if args.json:
        print(json.dumps(info))
        return 0
    print(f"{'made' if made else 'certificate'} {info['certificate']}\nfingerprint {cert.fingerprint}")
    if (folder / KEY_FILE).exists():
        print("a node's certificate: the coordinator hands it to the node's neighbours, who pin it")
    else:
        print(f"volunteers pin it with: tahnode join --coordinator-fingerprint {cert.fingerprint} ...")
    if info["trusted_coordinator"]:
        print(f"this node trusts the coordinator certificate {info['trusted_coordinator']} ({pinned})")
    return 0
