# Debian's etcd and etcdctl with the C library and loader they link against.
FROM scratch
COPY rootfs/ /
ENV ETCDCTL_API=3
EXPOSE 2379 2380
CMD ["/usr/bin/etcd"]
