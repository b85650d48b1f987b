/* The libmicrohttpd (C) stack of tests/tests/stacks.rs: the same streamed
 * completions as tests/stacks/apps.py, with libmicrohttpd doing all of the
 * HTTP (a response of unknown size, which it sends chunked). One thread per
 * connection, so the content reader may block for the GPU step. The steps call
 * the stub CUDA runtime of tests/fixtures (dlopen). With STACK_STAMPS set, each
 * request's own CLOCK_MONOTONIC stamps are appended there as a JSON line (see
 * stamp_free): when libmicrohttpd first hands the request to the handler (its
 * head read and parsed) and just before the reader returns the first token.
 *
 *   stack-mhd PORT CUDART          (built by the test: cc mhd.c -lmicrohttpd -ldl)
 */
#include <dlfcn.h>
#include <arpa/inet.h>
#include <microhttpd.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define STUB_KERNEL_MAGIC 0x4E52454B54465454ULL /* "TTFTKERN", cuda_api.h */
#define D2H 2
#define PREFILL_NS 20000000ULL
#define DECODE_NS 5000000ULL

typedef struct { unsigned x, y, z; } dim3;
struct kernel { uint64_t magic, duration_ns; };

static int (*launch)(const void *, dim3, dim3, void **, size_t, void *);
static int (*copy_async)(void *, const void *, size_t, int, void *);
static int (*stream_sync)(void *);
static int (*dev_malloc)(void **, size_t);
static void *dev;
static pthread_mutex_t gpu_lock = PTHREAD_MUTEX_INITIALIZER;

static int step(uint64_t ns) {
    struct kernel k = {STUB_KERNEL_MAGIC, ns};
    int32_t token = 0;
    dim3 grid = {1, 1, 1}, block = {128, 1, 1};
    pthread_mutex_lock(&gpu_lock);
    int rc = launch(&k, grid, block, NULL, 0, NULL);
    if (rc == 0) rc = copy_async(&token, dev, 4, D2H, NULL);
    if (rc == 0) rc = stream_sync(NULL);
    pthread_mutex_unlock(&gpu_lock);
    return rc;
}

enum kind { CHAT, COMPLETIONS, NDJSON };

struct stream {
    enum kind kind;
    int n, next; /* tokens to send, next to send (n: the end marker) */
    unsigned port; /* the client's */
    uint64_t t_read, t_send; /* the request's stamps (t_send 0: no token yet) */
};

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

static pthread_mutex_t stamps_lock = PTHREAD_MUTEX_INITIALIZER;

/* Frees a response's stream, after appending its stamps to $STACK_STAMPS: at the
 * response's end, so that the write costs it nothing before its first token. */
static void stamp_free(void *cls) {
    struct stream *s = cls;
    const char *path = getenv("STACK_STAMPS");
    if (path && *path && s->t_send) {
        pthread_mutex_lock(&stamps_lock);
        FILE *f = fopen(path, "a");
        if (f) {
            fprintf(f, "{\"client_port\":%u,\"t_read\":%llu,\"t_send\":%llu}\n", s->port,
                    (unsigned long long)s->t_read, (unsigned long long)s->t_send);
            fclose(f);
        }
        pthread_mutex_unlock(&stamps_lock);
    }
    free(s);
}

static ssize_t reader(void *cls, uint64_t pos, char *buf, size_t max) {
    struct stream *s = cls;
    (void)pos;
    if (s->next > s->n) return MHD_CONTENT_READER_END_OF_STREAM;
    int len;
    if (s->next == s->n) {
        len = s->kind == NDJSON
            ? snprintf(buf, max, "{\"model\":\"stack\",\"response\":\"\",\"done\":true}\n")
            : snprintf(buf, max, "data: [DONE]\n\n");
    } else {
        if (step(s->next == 0 ? PREFILL_NS : DECODE_NS) != 0)
            return MHD_CONTENT_READER_END_WITH_ERROR;
        int i = s->next;
        if (i == 0) s->t_send = now_ns();
        /* The last token gives its finish reason, as OpenAI's API does. */
        const char *finish = i == s->n - 1 ? "\"length\"" : "null";
        if (s->kind == CHAT)
            len = snprintf(buf, max,
                           "data: {\"id\":\"chatcmpl-stack\",\"object\":\"chat.completion.chunk\","
                           "\"created\":0,\"model\":\"stack\",\"choices\":[{\"index\":0,"
                           "\"delta\":{\"content\":\" tok%d\"},\"finish_reason\":%s}]}\n\n", i, finish);
        else if (s->kind == COMPLETIONS)
            len = snprintf(buf, max,
                           "data: {\"id\":\"cmpl-stack\",\"object\":\"text_completion\","
                           "\"created\":0,\"model\":\"stack\",\"choices\":[{\"index\":0,"
                           "\"text\":\" tok%d\",\"finish_reason\":%s}]}\n\n", i, finish);
        else
            len = snprintf(buf, max,
                           "{\"model\":\"stack\",\"response\":\" tok%d\",\"done\":false}\n", i);
    }
    s->next++;
    return len < 0 || (size_t)len >= max ? MHD_CONTENT_READER_END_WITH_ERROR : len;
}

/* The request body so far, per connection request, and when it was first seen. */
struct body { uint64_t t_read; size_t len; char data[4096]; };

static enum MHD_Result handle(void *cls, struct MHD_Connection *c, const char *url,
                              const char *method, const char *version, const char *upload,
                              size_t *upload_size, void **con_cls) {
    (void)cls; (void)method; (void)version;
    struct body *b = *con_cls;
    if (b == NULL) {
        uint64_t t_read = now_ns();
        b = calloc(1, sizeof *b);
        if (b == NULL) return MHD_NO;
        b->t_read = t_read;
        *con_cls = b;
        return MHD_YES;
    }
    if (*upload_size) {
        size_t take = *upload_size < sizeof b->data - 1 - b->len ? *upload_size
                                                                  : sizeof b->data - 1 - b->len;
        memcpy(b->data + b->len, upload, take);
        b->len += take;
        *upload_size = 0;
        return MHD_YES;
    }
    enum kind kind;
    if (strcmp(url, "/v1/chat/completions") == 0) kind = CHAT;
    else if (strcmp(url, "/v1/completions") == 0) kind = COMPLETIONS;
    else if (strcmp(url, "/api/generate") == 0) kind = NDJSON;
    else {
        struct MHD_Response *r = MHD_create_response_from_buffer(0, "", MHD_RESPMEM_PERSISTENT);
        enum MHD_Result ret = MHD_queue_response(c, MHD_HTTP_NOT_FOUND, r);
        MHD_destroy_response(r);
        return ret;
    }
    struct stream *s = calloc(1, sizeof *s);
    if (s == NULL) return MHD_NO;
    s->kind = kind;
    s->n = 8;
    s->t_read = b->t_read;
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(c, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
    if (ci && ci->client_addr && ci->client_addr->sa_family == AF_INET)
        s->port = ntohs(((const struct sockaddr_in *)ci->client_addr)->sin_port);
    const char *m = strstr(b->data, "\"max_tokens\"");
    if (m && (m = strchr(m, ':'))) s->n = atoi(m + 1) > 0 ? atoi(m + 1) : 1;
    struct MHD_Response *r = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 1024, reader, s,
                                                                stamp_free);
    MHD_add_response_header(r, "Content-Type",
                            kind == NDJSON ? "application/x-ndjson" : "text/event-stream");
    enum MHD_Result ret = MHD_queue_response(c, MHD_HTTP_OK, r);
    MHD_destroy_response(r);
    return ret;
}

static void done(void *cls, struct MHD_Connection *c, void **con_cls,
                 enum MHD_RequestTerminationCode why) {
    (void)cls; (void)c; (void)why;
    free(*con_cls);
    *con_cls = NULL;
}

static void *must(void *lib, const char *name) {
    void *p = dlsym(lib, name);
    if (p == NULL) { fprintf(stderr, "stack-mhd: %s missing\n", name); exit(1); }
    return p;
}

int main(int argc, char **argv) {
    if (argc != 3) { fprintf(stderr, "usage: stack-mhd PORT CUDART\n"); return 2; }
    /* The stub runtime binds to the stub driver next to it. */
    char drv[4096];
    snprintf(drv, sizeof drv, "%s", argv[2]);
    char *slash = strrchr(drv, '/');
    if (slash) { snprintf(slash + 1, sizeof drv - (size_t)(slash + 1 - drv), "libcuda.so.1");
                 dlopen(drv, RTLD_NOW | RTLD_GLOBAL); }
    void *lib = dlopen(argv[2], RTLD_NOW);
    if (lib == NULL) { fprintf(stderr, "stack-mhd: %s\n", dlerror()); return 1; }
    launch = must(lib, "cudaLaunchKernel");
    copy_async = must(lib, "cudaMemcpyAsync");
    stream_sync = must(lib, "cudaStreamSynchronize");
    dev_malloc = must(lib, "cudaMalloc");
    if (dev_malloc(&dev, 4) != 0) { fprintf(stderr, "stack-mhd: cudaMalloc failed\n"); return 1; }
    /* Blocked in every thread (MHD's inherit the mask), taken by sigwait. */
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    pthread_sigmask(SIG_BLOCK, &set, NULL);
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)atoi(argv[1])),
                               .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    struct MHD_Daemon *d = MHD_start_daemon(
        MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD, 0, NULL, NULL, handle,
        NULL, MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&addr, MHD_OPTION_NOTIFY_COMPLETED, done,
        NULL, MHD_OPTION_END);
    if (d == NULL) { fprintf(stderr, "stack-mhd: MHD_start_daemon failed\n"); return 1; }
    int sig;
    sigwait(&set, &sig);
    MHD_stop_daemon(d);
    return 0;
}
