# Prometheus for the compose cluster: Debian's binary with the libc and
# loader ldd names, in a scratch image. The compose file mounts
# deploy/prometheus (scrape config and alert rules) at /etc/prometheus and
# keeps the time series on a volume at /data.
FROM scratch
COPY rootfs/ /
EXPOSE 9090
CMD ["/usr/bin/prometheus", "--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/data", "--storage.tsdb.retention.time=2d", "--web.listen-address=0.0.0.0:9090"]
