# The Tessera image: `tessera` as the entry point with the CPU kernel library beside it
# (where it looks for it), running as a non-root user whose home holds the builtin
# model, generated at first start. Build from the repository root:
#   docker build -t tessera:latest .
# Vendor kernel libraries (`plugin:` backends) are added by an image built FROM this one.

FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p tessera -p tessera-kernels-cpu \
    && mkdir -p /out \
    && cp target/release/tessera target/release/libtessera_kernels_cpu.so /out/

FROM debian:bookworm-slim
RUN groupadd --gid 10001 tessera \
    && useradd --uid 10001 --gid 10001 --home-dir /var/lib/tessera --create-home --shell /usr/sbin/nologin tessera
COPY --from=build /out/ /opt/tessera/bin/
ENV TESSERA_HOME=/var/lib/tessera
USER 10001:10001
WORKDIR /var/lib/tessera
# bus, events, KV transfer (a host's bus port and the two after it), gateway, probe
EXPOSE 7400 7401 7402 8000 9000
ENTRYPOINT ["/opt/tessera/bin/tessera"]
CMD ["up"]
