# The cluster's S3-compatible object store: s3s-fs (crates.io, built by
# scripts/install-deps.sh cluster) with its libc, in a scratch image. Objects
# live as files under /data, a volume, so they outlive the container.
FROM scratch
COPY rootfs/ /
EXPOSE 5000
CMD ["/usr/local/bin/s3s-fs", "--host", "0.0.0.0", "--port", "5000", "--access-key", "adspend", "--secret-key", "adspend-secret", "/data"]
