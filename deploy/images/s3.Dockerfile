# moto's S3-compatible server on a minimal Debian root (debootstrap, then
# `docker import` as adspend/s3-root; moto installed under /opt/moto).
FROM adspend/s3-root:dev
COPY rootfs/ /
ENV PYTHONPATH=/opt/moto
EXPOSE 5000
CMD ["python3", "-m", "moto.server", "-H", "0.0.0.0", "-p", "5000"]
