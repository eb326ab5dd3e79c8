package main

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"log/slog"
	"net/http"
	"sync"
	"time"

	"github.com/idempotency-go/idempotency"
)

// headerRequestID names a request across the gateway, the proxy and the
// upstream: passed on when the client sent a usable one, made otherwise.
const headerRequestID = "X-Request-Id"

// front is what the proxy does to a client's request before the
// middleware sees it, and its access log after.
type front struct {
	// keyHeader is the canonical name of the field the clients send the
	// key in; the middleware reads it as idempotency.HeaderKey.
	keyHeader string
	access    *slog.Logger // nil: no access log
}

// handler wraps next, the middleware: the request gets its request id (for
// the upstream, which may echo it in its answer), and
// its key under the name the middleware reads; with an access log, one line
// is written once next returns.
func (f front) handler(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		start := time.Now()
		r = r.WithContext(r.Context()) // a shallow copy whose Header may be replaced
		r.Header = r.Header.Clone()
		id := requestID(r.Header.Get(headerRequestID))
		r.Header.Set(headerRequestID, id)
		key := r.Header.Values(f.keyHeader)
		if f.keyHeader != idempotency.HeaderKey {
			r.Header.Del(idempotency.HeaderKey)
			if len(key) > 0 {
				r.Header[idempotency.HeaderKey] = key
			}
		}
		if f.access == nil {
			next.ServeHTTP(w, r)
			return
		}
		e := &accessEntry{}
		sw := &statusWriter{ResponseWriter: w}
		next.ServeHTTP(sw, r.WithContext(context.WithValue(r.Context(), accessKey{}, e)))
		f.access.LogAttrs(r.Context(), slog.LevelInfo, "request",
			slog.String("method", r.Method), slog.String("path", r.URL.Path), slog.Int("status", sw.status()),
			slog.String("outcome", e.outcomeName()), slog.Int("attempt", e.attempt()),
			slog.Float64("duration_ms", float64(time.Since(start).Microseconds())/1000),
			slog.String("key_hash", keyHash(key)), slog.String("request_id", id))
	})
}

// requestID is v when it is a usable request id (1 to 128 visible ASCII
// characters), and a new random one otherwise.
func requestID(v string) string {
	ok := len(v) > 0 && len(v) <= 128
	for i := 0; ok && i < len(v); i++ {
		ok = v[i] > ' ' && v[i] < 0x7f
	}
	if ok {
		return v
	}
	b := make([]byte, 16)
	_, _ = rand.Read(b) // never fails (crypto/rand)
	return hex.EncodeToString(b)
}

// keyHash names a key in the access log without giving it away: the first
// 16 bytes of the SHA-256 of the field's value, in hex; "" without a key.
// The same key hashes the same on every proxy, so a retry can be followed.
func keyHash(values []string) string {
	if len(values) != 1 {
		return ""
	}
	sum := sha256.Sum256([]byte(values[0]))
	return hex.EncodeToString(sum[:16])
}

// accessKey is the context key of a request's *accessEntry.
type accessKey struct{}

// accessEntry is what the Guard told of a request, for its access log
// line: the outcome of its call, if the middleware guarded it.
type accessEntry struct {
	mu sync.Mutex
	ev *idempotency.Event
}

func (e *accessEntry) attempt() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.ev == nil {
		return 0
	}
	return e.ev.Attempt
}

// outcomeName is the access log's outcome: new (the upstream ran),
// replayed, waited (for the original, then replayed), refused (the request
// or its key was refused, or the original is still in flight), failed (the
// store, the lease or the client failed the call), or unguarded.
func (e *accessEntry) outcomeName() string {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.ev == nil {
		return "unguarded"
	}
	switch e.ev.Outcome {
	case idempotency.OutcomeExecuted, idempotency.OutcomeWaitedOwner, idempotency.OutcomeReleased,
		idempotency.OutcomeForgotten:
		return "new"
	case idempotency.OutcomeReplayed, idempotency.OutcomeRecovered:
		return "replayed"
	case idempotency.OutcomeWaitedReplayed:
		return "waited"
	case idempotency.OutcomeInFlight, idempotency.OutcomeMismatch, idempotency.OutcomeInvalidKey,
		idempotency.OutcomeRejected, idempotency.OutcomeRecoveryUnknown:
		return "refused"
	case idempotency.OutcomeFailedOpen:
		return "unguarded"
	}
	return "failed"
}

// accessObserver hands each call's outcome to the access log entry in its
// context, then to next, which it otherwise stands for.
type accessObserver struct {
	idempotency.PhaseObserver
}

func (o accessObserver) Observe(ctx context.Context, e idempotency.Event) {
	if entry, ok := ctx.Value(accessKey{}).(*accessEntry); ok && e.Kind == idempotency.EventOutcome {
		entry.mu.Lock()
		entry.ev = &e
		entry.mu.Unlock()
	}
	o.PhaseObserver.Observe(ctx, e)
}

// statusWriter remembers the status a handler answered.
type statusWriter struct {
	http.ResponseWriter
	code int
}

func (w *statusWriter) WriteHeader(code int) {
	if w.code == 0 && code >= 200 {
		w.code = code
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *statusWriter) Write(b []byte) (int, error) {
	if w.code == 0 {
		w.code = http.StatusOK
	}
	return w.ResponseWriter.Write(b)
}

// Unwrap lets http.ResponseController reach the connection's Flush.
func (w *statusWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

func (w *statusWriter) status() int {
	if w.code == 0 {
		return http.StatusOK
	}
	return w.code
}
