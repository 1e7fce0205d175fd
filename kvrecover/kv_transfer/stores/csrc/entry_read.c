/* Stored entries read into staging rows and hashed, many per call, off the GIL.
 *
 * A Python reader thread pays for the GIL at every system call it makes (open, fstat,
 * readv, close) and at the hash: with 8-16 reader threads that hand-over, not the
 * copying, bounds a staged load. One call here reads a chunk of entries with none
 * of it (`entry_read.py`). Headers are checked by the caller, in Python.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

typedef uint64_t (*kvr_hash_fn)(const void *data, size_t length);

enum { KVR_READ = 0, KVR_NOT_REGULAR = 1, KVR_WRONG_SIZE = 2, KVR_ENDED = 3 };

/* For each i < count: open paths[i], check it is a regular file of prefix_nbytes +
 * payload_nbytes bytes, read its prefix into prefixes + i * prefix_nbytes and its
 * payload into rows + i * row_stride, and hash the payload into checksums[i].
 * status[i]: KVR_READ, -errno of a failed call, KVR_NOT_REGULAR, KVR_WRONG_SIZE
 * (sizes[i]: the file's size) or KVR_ENDED (sizes[i]: the bytes read). Unless
 * every_row, stops after the first entry that failed; returns how many were tried. */
int64_t kvr_read_entries(const char *const *paths, int64_t count, uint8_t *prefixes,
                         int64_t prefix_nbytes, uint8_t *rows, int64_t row_stride,
                         int64_t payload_nbytes, kvr_hash_fn hash, uint64_t *checksums,
                         int32_t *status, int64_t *sizes, int32_t every_row) {
    const int64_t entry_nbytes = prefix_nbytes + payload_nbytes;
    int64_t i;
    for (i = 0; i < count; ++i) {
        int fd = open(paths[i], O_RDONLY | O_NONBLOCK | O_CLOEXEC);
        struct stat info;
        status[i] = KVR_READ;
        sizes[i] = 0;
        if (fd < 0) {
            status[i] = -errno;
        } else if (fstat(fd, &info) != 0) {
            status[i] = -errno;
        } else if (!S_ISREG(info.st_mode)) {
            status[i] = KVR_NOT_REGULAR;
        } else if (info.st_size != entry_nbytes) {
            status[i] = KVR_WRONG_SIZE;
            sizes[i] = info.st_size;
        } else {
            struct iovec parts[2] = {
                {prefixes + i * prefix_nbytes, (size_t)prefix_nbytes},
                {rows + i * row_stride, (size_t)payload_nbytes},
            };
            ssize_t got = readv(fd, parts, 2);
            if (got < 0) {
                status[i] = -errno;
            } else if (got != entry_nbytes) {
                status[i] = KVR_ENDED;
                sizes[i] = got;
            } else {
                checksums[i] = hash(rows + i * row_stride, (size_t)payload_nbytes);
            }
        }
        if (fd >= 0) {
            close(fd);
        }
        if (status[i] != KVR_READ && !every_row) {
            return i + 1;
        }
    }
    return count;
}
