package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync"

	"github.com/idempotency-go/idempotency"
)

// The headers the proxy sets on every guarded request it sends upstream,
// for the upstream to make its own side effects safe (docs/proxy.md). A
// client's own copies are removed from every request, guarded or not, so
// that only the proxy speaks for an operation.
const (
	// headerOperationKey is the same for every attempt at one operation:
	// the upstream's idempotency key for its own side effects.
	headerOperationKey = "Idempotency-Operation-Key"
	// headerFencingToken is greater at every attempt at an operation: an
	// upstream that keeps the greatest it has seen for the operation can
	// refuse the writes of an attempt that was taken over.
	headerFencingToken = "Idempotency-Fencing-Token"
	// headerAttempt counts the attempts at the operation, from 1: above 1,
	// an earlier attempt may have done part of the work.
	headerAttempt = "Idempotency-Attempt"
)

// downstreamName names the upstream for idempotency.DownstreamKey.
const downstreamName = "upstream"

// forwardingHeaders are the fields that tell an upstream who the client is
// and what it asked for (scheme, host, port, prefix): Rack, Rails, Django
// and Express read them to build URLs and to decide whether a request came
// over TLS. Each is either the proxy's own view or, with -trust-forwarded,
// the gateway's; never a client's.
var forwardingHeaders = []string{
	"Forwarded", "X-Forwarded-For", "X-Forwarded-Host", "X-Forwarded-Proto", "X-Forwarded-Port",
	"X-Forwarded-Prefix", "X-Forwarded-Ssl", "X-Forwarded-Scheme", "X-Real-Ip", "Client-Ip",
}

// upstreamOptions is how the proxy talks to its upstream.
type upstreamOptions struct {
	target         *url.URL
	trustForwarded bool
	// protected holds the canonical names of the fields whose spelling
	// with "_" for "-" never reaches the upstream (see dropAliases).
	protected map[string]bool
	// keyHeader is the canonical name the clients and the upstream give
	// the key; when it is not idempotency.HeaderKey, the Idempotency-Key
	// field the upstream gets is the proxy's copy for the middleware, and
	// is removed.
	keyHeader string
	transport http.RoundTripper
	dial      func(context.Context) error // see upstreamDialer
	log       *slog.Logger
}

// upstreamDialer returns a function that opens a connection to the
// upstream, over socket unless it is "", and closes it: whether the
// upstream takes connections, for /readyz.
func upstreamDialer(target *url.URL, socket string) func(context.Context) error {
	network, addr := "tcp", target.Host
	switch {
	case socket != "":
		network, addr = "unix", socket
	case target.Port() == "" && target.Scheme == "https":
		addr = net.JoinHostPort(target.Hostname(), "443")
	case target.Port() == "":
		addr = net.JoinHostPort(target.Hostname(), "80")
	}
	return func(ctx context.Context) error {
		var d net.Dialer
		conn, err := d.DialContext(ctx, network, addr)
		if err == nil {
			conn.Close()
		}
		return err
	}
}

// upstreamHandler forwards each request to the target, with the operation's
// headers when it is guarded, and cancels the upstream request when the
// operation's context ends (its timeout, or the lease lost): what comes
// back then is never stored or sent. An upstream that cannot be reached
// is answered 502, and one cancelled at the operation's timeout 504; both
// release the key, so that the client's retry runs again.
func upstreamHandler(o upstreamOptions) http.Handler {
	return &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(o.target)
			dropAliases(pr.Out.Header, o.protected)
			setForwarded(pr, o.trustForwarded)
			if setOperationHeaders(pr.In.Context(), pr.Out.Header) && pr.Out.Body != nil {
				sendBufferedBody(pr)
			}
			if o.keyHeader != idempotency.HeaderKey {
				pr.Out.Header.Del(idempotency.HeaderKey)
			}
			hideKeyFromTransport(pr.Out.Header)
		},
		Transport:  o.transport,
		BufferPool: copyBuffers,
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			status := http.StatusBadGateway
			if errors.Is(r.Context().Err(), context.DeadlineExceeded) {
				status = http.StatusGatewayTimeout
			}
			o.log.Warn("upstream request failed", "method", r.Method, "path", r.URL.Path, "status", status, "err", err)
			w.WriteHeader(status)
		},
		ErrorLog: slog.NewLogLogger(o.log.Handler(), slog.LevelWarn),
	}
}

// copyBuffers are the buffers the proxy copies upstream answers through,
// reused: without a pool, httputil.ReverseProxy allocates 32 KiB for every
// request, which was half of what a new operation allocated.
var copyBuffers = &bufferPool{pool: sync.Pool{New: func() any { b := make([]byte, 32<<10); return &b }}}

// bufferPool is a sync.Pool of byte slices as an httputil.BufferPool.
type bufferPool struct{ pool sync.Pool }

func (p *bufferPool) Get() []byte { return *p.pool.Get().(*[]byte) }

// Put takes back b, a slice Get returned; ReverseProxy puts back what it got.
func (p *bufferPool) Put(b []byte) { p.pool.Put(&b) }

// newTransport is the connection pool to the upstream: over socket when
// it is not "", trusting the CA certificates in the PEM file ca when it is
// not "" (the system's otherwise), presenting the client certificate in
// certFile and keyFile when they are not "".
func newTransport(socket, ca, certFile, keyFile string) (*http.Transport, error) {
	t := http.DefaultTransport.(*http.Transport).Clone()
	t.MaxIdleConnsPerHost = 256
	if socket != "" {
		var d net.Dialer
		t.DialContext = func(ctx context.Context, _, _ string) (net.Conn, error) {
			return d.DialContext(ctx, "unix", socket)
		}
	} else {
		dial := t.DialContext
		t.DialContext = func(ctx context.Context, network, addr string) (net.Conn, error) {
			conn, err := dial(ctx, network, addr)
			if err != nil {
				return nil, err
			}
			return quickAck(conn), nil
		}
	}
	t.TLSClientConfig = &tls.Config{MinVersion: tls.VersionTLS12}
	if ca != "" {
		pem, err := os.ReadFile(ca)
		if err != nil {
			return nil, fmt.Errorf("-upstream-ca: %w", err)
		}
		t.TLSClientConfig.RootCAs = x509.NewCertPool()
		if !t.TLSClientConfig.RootCAs.AppendCertsFromPEM(pem) {
			return nil, usageError{fmt.Sprintf("-upstream-ca %s: no PEM certificate in it", ca)}
		}
	}
	if (certFile == "") != (keyFile == "") {
		return nil, usageError{"-upstream-cert and -upstream-key go together"}
	}
	if certFile != "" {
		cert, err := tls.LoadX509KeyPair(certFile, keyFile)
		if err != nil {
			return nil, fmt.Errorf("-upstream-cert, -upstream-key: %w", err)
		}
		t.TLSClientConfig.Certificates = []tls.Certificate{cert}
	}
	return t, nil
}

// protectedHeaders is the set dropAliases guards: every field the proxy
// sets itself, the key's, the scope's and the fingerprinted ones.
func protectedHeaders(keyHeader, scopeHeader string, fingerprint []string) map[string]bool {
	names := append([]string{headerOperationKey, headerFencingToken, headerAttempt,
		idempotency.HeaderKey, "X-Idempotency-Key", keyHeader, scopeHeader}, forwardingHeaders...)
	set := map[string]bool{}
	for _, n := range append(names, fingerprint...) {
		if n != "" {
			set[http.CanonicalHeaderKey(n)] = true
		}
	}
	return set
}

// dropAliases removes from h every field whose name has a "_" and, read
// with "-" for each "_", names a field in protected. Rack and WSGI hand a
// field to the application as HTTP_ and its name in capitals, "-" as "_":
// Idempotency_Fencing_Token and Idempotency-Fencing-Token are then one
// variable, and a client could forge what only the proxy or the gateway
// may say.
func dropAliases(h http.Header, protected map[string]bool) {
	for name := range h {
		if strings.Contains(name, "_") && protected[http.CanonicalHeaderKey(strings.ReplaceAll(name, "_", "-"))] {
			delete(h, name)
		}
	}
}

// setForwarded sets the forwarding fields of pr.Out: from the proxy's own
// view (the client's address, the Host it asked for, http or https as it
// reached the proxy), or, when trusted, as the gateway sent them, the
// proxy adding the gateway's address to X-Forwarded-For. Rewrite has
// already removed Forwarded and X-Forwarded-For, -Host and -Proto from
// pr.Out; the others are removed here.
func setForwarded(pr *httputil.ProxyRequest, trusted bool) {
	for _, name := range forwardingHeaders {
		pr.Out.Header.Del(name)
	}
	if !trusted {
		pr.SetXForwarded()
		return
	}
	pr.Out.Header["X-Forwarded-For"] = pr.In.Header["X-Forwarded-For"]
	pr.SetXForwarded()
	for _, name := range forwardingHeaders {
		if v := pr.In.Header[name]; len(v) > 0 && name != "X-Forwarded-For" {
			pr.Out.Header[name] = v
		}
	}
}

// hideKeyFromTransport keeps http.Transport from sending a request twice.
// The Transport resends a request without a body on a new connection when
// a reused one fails after the request was written, if it deems the
// request idempotent: a GET, or one whose Header map has an
// "Idempotency-Key" or "X-Idempotency-Key" entry (net/http's
// Request.isReplayable). The upstream would then run one attempt twice.
// Those fields are moved to lower-case entries, which the map lookup does
// not match and which go on the wire as the same fields (HTTP field names
// are case-insensitive). A request with a body is never resent: the
// proxy's has no GetBody.
func hideKeyFromTransport(h http.Header) {
	for _, name := range []string{idempotency.HeaderKey, "X-Idempotency-Key"} {
		if v, ok := h[name]; ok {
			delete(h, name)
			h[strings.ToLower(name)] = v
		}
	}
}

// setOperationHeaders replaces h's operation headers with those of the
// operation in ctx, if there is one, and reports whether there is.
func setOperationHeaders(ctx context.Context, h http.Header) bool {
	h.Del(headerOperationKey)
	h.Del(headerFencingToken)
	h.Del(headerAttempt)
	i, ok := idempotency.FromContext(ctx)
	if !ok {
		return false
	}
	key, _ := idempotency.DownstreamKey(ctx, downstreamName) // ctx carries the operation
	h.Set(headerOperationKey, key)
	h.Set(headerFencingToken, strconv.FormatUint(i.Token, 10))
	h.Set(headerAttempt, strconv.Itoa(i.Attempt))
	return true
}

// sendBufferedBody gives the upstream request of a guarded request, pr, the
// body the middleware buffered (docs/http.md: the handler reads the
// buffered body) instead of ReverseProxy's wrapper around it. The
// Transport writes the header on its own, then the body, in two sends, for
// a body it does not know to be in memory; this one it knows, and sends
// the two together: one segment for a small request, and one read less for
// the upstream. Closing that body, as the Transport may on a failed dial,
// does nothing. GetBody stays nil, so the Transport never resends the
// request (see hideKeyFromTransport).
func sendBufferedBody(pr *httputil.ProxyRequest) {
	pr.Out.Body = pr.In.Body
	pr.Out.GetBody = nil
}
