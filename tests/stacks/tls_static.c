/*
 * An HTTPS server with OpenSSL linked into its own executable and its
 * symbols exported (as Node ships it), for the TLS test (tests/tests/tls.rs):
 * the tracer must find OpenSSL in the server's binary, not in a libssl.so.
 *
 *   cc -O2 -o tls-static tls_static.c -rdynamic \
 *      -Wl,--whole-archive -l:libssl.a -Wl,--no-whole-archive -l:libcrypto.a -ldl -lpthread
 *   tls-static PORT CERT KEY CUDART
 *
 * One connection at a time (the test's client connects one after another):
 * the handshake, one request read whole, then a streamed completion as
 * OpenAI's API writes one (SSE, chunked): the headers, a 20 ms "prefill",
 * 4 tokens 5 ms apart, `data: [DONE]`, the end; then the close. The stub
 * CUDA runtime is mapped so that the tracer follows the process.
 */
#define _GNU_SOURCE /* strcasestr */
#include <arpa/inet.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static void sleep_ms(long ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* Writes `data` as one chunk of the body; 0 on success. */
static int chunk(SSL *ssl, const char *data) {
    char buf[512];
    int n = snprintf(buf, sizeof buf, "%zx\r\n%s\r\n", strlen(data), data);
    return n > 0 && n < (int)sizeof buf && SSL_write(ssl, buf, n) == n ? 0 : -1;
}

/* Reads the request's headers and its Content-Length body; 0 on success. */
static int read_request(SSL *ssl) {
    char buf[8192];
    size_t have = 0;
    char *end = NULL;
    while (!end) {
        if (have == sizeof buf - 1) return -1;
        int n = SSL_read(ssl, buf + have, (int)(sizeof buf - 1 - have));
        if (n <= 0) return -1;
        have += (size_t)n;
        buf[have] = '\0';
        end = strstr(buf, "\r\n\r\n");
    }
    const char *cl = strcasestr(buf, "content-length:");
    size_t body = cl && cl < end ? strtoul(cl + 15, NULL, 10) : 0;
    size_t got = have - (size_t)(end + 4 - buf);
    while (got < body) {
        int n = SSL_read(ssl, buf, sizeof buf);
        if (n <= 0) return -1;
        got += (size_t)n;
    }
    return 0;
}

static void serve(SSL *ssl) {
    static const char *headers =
        "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
        "Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n";
    if (SSL_accept(ssl) != 1 || read_request(ssl) != 0) return;
    if (SSL_write(ssl, headers, (int)strlen(headers)) <= 0) return;
    sleep_ms(20);
    for (int i = 0; i < 4; i++) {
        char event[256];
        snprintf(event, sizeof event,
                 "data: {\"id\":\"cmpl-static\",\"object\":\"text_completion\",\"created\":0,"
                 "\"model\":\"static\",\"choices\":[{\"index\":0,\"text\":\" tok%d\","
                 "\"finish_reason\":%s}]}\n\n",
                 i, i == 3 ? "\"length\"" : "null");
        if (chunk(ssl, event) != 0) return;
        if (i < 3) sleep_ms(5);
    }
    if (chunk(ssl, "data: [DONE]\n\n") != 0) return;
    if (SSL_write(ssl, "0\r\n\r\n", 5) != 5) return;
    SSL_shutdown(ssl);
}

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: %s PORT CERT KEY CUDART\n", argv[0]);
        return 2;
    }
    if (!dlopen(argv[4], RTLD_NOW)) {
        fprintf(stderr, "dlopen %s: %s\n", argv[4], dlerror());
        return 1;
    }
    SSL_CTX *ctx = SSL_CTX_new(TLS_server_method());
    if (!ctx || SSL_CTX_use_certificate_chain_file(ctx, argv[2]) != 1 ||
        SSL_CTX_use_PrivateKey_file(ctx, argv[3], SSL_FILETYPE_PEM) != 1) {
        ERR_print_errors_fp(stderr);
        return 1;
    }
    /* TLS 1.2 resumes by session id: the cache needs an id context. */
    SSL_CTX_set_session_id_context(ctx, (const unsigned char *)"tls-static", 10);
    int srv = socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    setsockopt(srv, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)atoi(argv[1]))};
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(srv, (struct sockaddr *)&addr, sizeof addr) != 0 || listen(srv, 16) != 0) {
        perror("bind/listen");
        return 1;
    }
    for (;;) {
        int fd = accept(srv, NULL, NULL);
        if (fd < 0) continue;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        SSL *ssl = SSL_new(ctx);
        if (ssl && SSL_set_fd(ssl, fd) == 1) serve(ssl);
        SSL_free(ssl);
        close(fd);
    }
}
