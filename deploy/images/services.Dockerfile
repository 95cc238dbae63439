# limiter, aggregator, pacer and the health probe: static glibc binaries
# (scripts/cluster.sh builds them with +crt-static) on an empty image.
FROM scratch
COPY rootfs/ /
WORKDIR /data
ENTRYPOINT ["/usr/local/bin/aggregator"]
