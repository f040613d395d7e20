"""Mutual TLS for the two gRPC planes (router → decode, decode → prefill).

With `tls_cert`, `tls_key` and `tls_ca` set, a service serves only over TLS and requires every
caller to present a certificate that chains to `tls_ca`; the decode worker calls its prefill
replicas the same way, with its own certificate. Prefill replicas are reached by IP (from DNS), so
the decode side checks the name their certificates carry (`tls_server_name`) rather than the
address. Kubernetes' gRPC probes cannot speak TLS: the health service is then also served alone,
in plaintext, on `health_port` (it says only SERVING or NOT_SERVING). `plaintext` turns TLS off;
the service logs it at start. The handoff keys that seal the data plane travel on these channels,
so they are secret only with TLS on.
"""

from __future__ import annotations

from pathlib import Path

import grpc

from services.settings import ServiceSettings


def _read(settings: ServiceSettings, field: str) -> bytes:
    path = Path(getattr(settings, field))
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ValueError(f"{field}: cannot read {path}: {exc.strerror}") from None


def server_credentials(settings: ServiceSettings) -> grpc.ServerCredentials | None:
    """None with `plaintext`; else TLS that requires a client certificate from `tls_ca`."""
    if settings.plaintext:
        return None
    return grpc.ssl_server_credentials(
        [(_read(settings, "tls_key"), _read(settings, "tls_cert"))],
        root_certificates=_read(settings, "tls_ca"), require_client_auth=True)


def secure_channel(settings: ServiceSettings, address: str) -> grpc.aio.Channel:
    """A channel to a peer service: mutual TLS unless `plaintext`."""
    if settings.plaintext:
        return grpc.aio.insecure_channel(address)
    credentials = grpc.ssl_channel_credentials(
        root_certificates=_read(settings, "tls_ca"), private_key=_read(settings, "tls_key"),
        certificate_chain=_read(settings, "tls_cert"))
    options = ([("grpc.ssl_target_name_override", settings.tls_server_name)]
               if settings.tls_server_name else [])
    return grpc.aio.secure_channel(address, credentials, options=options)


def describe(settings: ServiceSettings) -> str:
    data = ("data plane authenticated per handoff and encrypted" if settings.encrypt_data_plane
            else "data plane authenticated per handoff, not encrypted")
    if settings.role == "prefill":
        data = "data plane authenticated per handoff, encrypted when the decode side asks"
    if settings.plaintext:
        return ("PLAINTEXT: gRPC without TLS, and the data plane's handoff keys readable by "
                f"anyone on the path (plaintext was set explicitly); {data}")
    return f"mutual TLS (certificate {settings.tls_cert}, CA {settings.tls_ca}); {data}"
