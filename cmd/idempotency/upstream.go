package main

import (
	"context"
	"errors"
	"log/slog"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strconv"

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

// upstreamHandler forwards each request to target, with the operation's
// headers when it is guarded, and cancels the upstream request when the
// operation's context ends (its timeout, or the lease lost): what comes
// back then is never stored or sent. An upstream that cannot be reached
// is answered 502, and one cancelled at the operation's timeout 504; both
// release the key, so that the client's retry runs again.
func upstreamHandler(target *url.URL, trustForwarded bool, log *slog.Logger) http.Handler {
	transport := http.DefaultTransport.(*http.Transport).Clone()
	transport.MaxIdleConnsPerHost = 256
	return &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(target)
			if trustForwarded {
				pr.Out.Header["X-Forwarded-For"] = pr.In.Header["X-Forwarded-For"]
			}
			pr.SetXForwarded()
			setOperationHeaders(pr.In.Context(), pr.Out.Header)
		},
		Transport: transport,
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			status := http.StatusBadGateway
			if errors.Is(r.Context().Err(), context.DeadlineExceeded) {
				status = http.StatusGatewayTimeout
			}
			log.Warn("upstream request failed", "method", r.Method, "path", r.URL.Path, "status", status, "err", err)
			w.WriteHeader(status)
		},
		ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelWarn),
	}
}

// setOperationHeaders replaces h's operation headers with those of the
// operation in ctx, if there is one.
func setOperationHeaders(ctx context.Context, h http.Header) {
	h.Del(headerOperationKey)
	h.Del(headerFencingToken)
	h.Del(headerAttempt)
	i, ok := idempotency.FromContext(ctx)
	if !ok {
		return
	}
	key, _ := idempotency.DownstreamKey(ctx, downstreamName) // ctx carries the operation
	h.Set(headerOperationKey, key)
	h.Set(headerFencingToken, strconv.FormatUint(i.Token, 10))
	h.Set(headerAttempt, strconv.Itoa(i.Attempt))
}
