package idempotency

import (
	"context"
	crand "crypto/rand"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net/http"
	"slices"
	"strconv"
	"time"
)

// RetryPolicy says how a client retries one logical request: how many
// attempts it makes and how long it waits between them, with capped
// exponential backoff and full jitter, so that many clients that failed
// together do not retry together. The zero value of every field is its
// documented default.
type RetryPolicy struct {
	// MaxAttempts bounds the attempts at one request, the first included.
	// Default 4; 1 never retries.
	MaxAttempts int
	// BaseDelay bounds the wait before the second attempt; each later bound
	// doubles. Default 100ms.
	BaseDelay time.Duration
	// MaxDelay caps every wait, a server's Retry-After included: a server
	// that asks for a longer one gets its answer returned instead of a
	// retry. Default 10s.
	MaxDelay time.Duration
}

func (p RetryPolicy) withDefaults() RetryPolicy {
	if p.MaxAttempts <= 0 {
		p.MaxAttempts = 4
	}
	if p.BaseDelay <= 0 {
		p.BaseDelay = 100 * time.Millisecond
	}
	if p.MaxDelay <= 0 {
		p.MaxDelay = 10 * time.Second
	}
	return p
}

// Attempts returns how many attempts p allows, its default applied.
func (p RetryPolicy) Attempts() int { return p.withDefaults().MaxAttempts }

// Backoff returns how long to wait after the attempt numbered attempt (1 for
// the first) failed: a uniformly random duration in [0, bound], where bound
// is BaseDelay·2^(attempt-1), capped at MaxDelay.
func (p RetryPolicy) Backoff(attempt int) time.Duration {
	p = p.withDefaults()
	bound := p.MaxDelay
	if attempt < 1 {
		attempt = 1
	}
	if shift := attempt - 1; shift < 62 && p.BaseDelay <= p.MaxDelay>>shift {
		bound = p.BaseDelay << shift
	}
	// In uint64, bound+1 cannot overflow, even for a MaxDelay of
	// math.MaxInt64 (a client that honours any Retry-After).
	return time.Duration(rand.Uint64N(uint64(bound) + 1))
}

// discardLimit bounds the bytes read from a response that is thrown away
// for a retry: enough for an error body, so that its connection is reused,
// without reading a large body only to drop it.
const discardLimit = 4 << 10

// Transport is an http.RoundTripper for clients of an API that honours
// Idempotency-Key, such as one built on Guard.Middleware or Stripe's: it
// retries a request under one key, so that however many of its attempts
// reach the server, the server runs the operation at most once and the
// caller gets the answer. Its zero value is ready to use, and it is safe
// for concurrent use.
//
// A RoundTrip of a guarded method is one logical request. It keeps the
// request's Idempotency-Key field if it has one; otherwise it adds a new
// key from crypto/rand.Text: at least 128 random bits in the RFC 4648
// base32 alphabet (26 characters today). Every attempt carries that same
// key. Another request is passed to Base once, untouched: no key, no retry.
// A caller that also retries on its own, across RoundTrips (a job run again
// tomorrow), sets the key itself, so that all its attempts share it. A key
// field that is present but empty, malformed or repeated fails RoundTrip
// with ErrInvalidKey before anything is sent.
//
// An attempt is retried, up to Retry.MaxAttempts attempts in all, when:
//   - Base returned an error and the request's context has not ended (a
//     network failure: the server may or may not have seen the attempt);
//   - or the response's status is 409, 429, 502, 503 or 504, unless it
//     carries "Stripe-Should-Retry: false";
//   - or the response carries "Stripe-Should-Retry: true" and its status is
//     another error (4xx or 5xx) but neither 400 nor 422, which say that the
//     request itself is wrong and are never retried.
//
// Before each retry it waits Retry.Backoff, or longer if the response asks
// for more in Retry-After (delta-seconds or an HTTP-date, RFC 9110 §10.2.3).
// A response whose Retry-After is longer than Retry.MaxDelay is returned
// instead of retried. Each retry sends the body again from the request's
// GetBody; a request with a body and no GetBody is sent once. The request's
// context ends the wait and every attempt (http.Client.Timeout sets one), so
// a logical request takes no longer than it allows.
//
// The response returned is the last attempt's. Its Request is the request
// that attempt sent, so resp.Request.Header.Get(HeaderKey) is the key used.
// Each response not returned has its body read (up to 4 KiB) and closed, so
// that its connection is reused. When the last attempt fails, the error
// says how many attempts were made and wraps Base's error or the context's
// cause. The caller's request is never modified.
//
// net/http's own Transport also resends, on a new connection, a request
// that carries an Idempotency-Key (and whose body it can rewind) when a
// connection it reused fails before the first byte of the response: it
// counts that field as a promise that the request may be replayed. Under
// this Transport that resend carries the same key as every attempt, so the
// server still runs the operation once.
type Transport struct {
	// Base sends each attempt. Default http.DefaultTransport.
	Base http.RoundTripper
	// Methods are the guarded request methods, compared case-sensitively,
	// as in MiddlewareOptions. Default POST and PATCH.
	Methods []string
	// Retry schedules the attempts at one logical request; its zero value
	// means RetryPolicy's defaults.
	Retry RetryPolicy
}

// checkKeyField refuses the Idempotency-Key field values that a server
// would refuse, an empty one among them: a request must never go out under
// a key that cannot deduplicate it.
func checkKeyField(values []string) error {
	if len(values) > 1 {
		return fmt.Errorf("%w: %s set %d times", ErrInvalidKey, HeaderKey, len(values))
	}
	for _, v := range values {
		if _, err := keyName(v); err != nil {
			return err
		}
	}
	return nil
}

// RoundTrip sends req as one logical request, with retries if its method
// is guarded, as Transport describes.
func (t *Transport) RoundTrip(req *http.Request) (*http.Response, error) {
	base := t.base()
	if !t.guards(req.Method) {
		return base.RoundTrip(req)
	}
	first := req.Clone(req.Context())
	if first.Header == nil {
		first.Header = make(http.Header)
	}
	if err := checkKeyField(first.Header.Values(HeaderKey)); err != nil {
		if req.Body != nil {
			_ = req.Body.Close() // as a RoundTripper must, on errors too
		}
		return nil, err
	}
	if len(first.Header.Values(HeaderKey)) == 0 {
		first.Header.Set(HeaderKey, crand.Text())
	}
	p := t.Retry.withDefaults()
	attempts := p.MaxAttempts
	if req.Body != nil && req.Body != http.NoBody && req.GetBody == nil {
		attempts = 1
	}
	return t.attempt(base, req, first, p, attempts)
}

// attempt sends first, and again under its key until an answer is final or
// attempts were made, as Transport describes.
func (t *Transport) attempt(base http.RoundTripper, req, first *http.Request, p RetryPolicy, attempts int) (*http.Response, error) {
	ctx := req.Context()
	send := first
	for n := 1; ; n++ {
		resp, err := base.RoundTrip(send)
		var wait time.Duration
		if err != nil {
			if n == attempts || ctx.Err() != nil {
				return nil, fmt.Errorf("idempotency: gave up after attempt %d: %w", n, err)
			}
			wait = p.Backoff(n)
		} else {
			retry, after := retryable(resp, time.Now())
			if !retry || n == attempts || after > p.MaxDelay {
				if resp.Request == nil {
					resp.Request = send
				}
				return resp, nil
			}
			_, _ = io.CopyN(io.Discard, resp.Body, discardLimit)
			_ = resp.Body.Close()
			wait = max(after, p.Backoff(n))
		}
		if err := sleep(ctx, wait); err != nil {
			return nil, fmt.Errorf("idempotency: gave up after attempt %d: %w", n, err)
		}
		send = first.Clone(ctx)
		if req.Body != nil && req.Body != http.NoBody {
			if send.Body, err = req.GetBody(); err != nil {
				return nil, fmt.Errorf("idempotency: rewinding the body for attempt %d: %w", n+1, err)
			}
		}
	}
}

// CloseIdleConnections closes Base's idle connections, if Base has such a
// method, so that http.Client.CloseIdleConnections reaches through the
// Transport.
func (t *Transport) CloseIdleConnections() {
	if c, ok := t.base().(interface{ CloseIdleConnections() }); ok {
		c.CloseIdleConnections()
	}
}

func (t *Transport) base() http.RoundTripper {
	if t.Base == nil {
		return http.DefaultTransport
	}
	return t.Base
}

func (t *Transport) guards(method string) bool {
	if len(t.Methods) == 0 {
		return method == http.MethodPost || method == http.MethodPatch
	}
	return slices.Contains(t.Methods, method)
}

// retryable reports whether the attempt that got resp should be retried
// and, if so, the wait its Retry-After asks for (0 without one).
func retryable(resp *http.Response, now time.Time) (bool, time.Duration) {
	code := resp.StatusCode
	if code == http.StatusBadRequest || code == http.StatusUnprocessableEntity {
		return false, 0
	}
	var retry bool
	switch resp.Header.Get("Stripe-Should-Retry") {
	case "false":
		return false, 0
	case "true":
		retry = code >= 400
	default:
		switch code {
		case http.StatusConflict, http.StatusTooManyRequests, http.StatusBadGateway,
			http.StatusServiceUnavailable, http.StatusGatewayTimeout:
			retry = true
		}
	}
	if !retry {
		return false, 0
	}
	return true, retryAfter(resp.Header.Get("Retry-After"), now)
}

// retryAfter reads a Retry-After field value; one it cannot read asks for
// no wait, and one too large for a Duration asks for the longest.
func retryAfter(v string, now time.Time) time.Duration {
	if v == "" {
		return 0
	}
	// ParseUint takes digits only, the delay-seconds grammar; a number too
	// large for it is still a delay, and a long one.
	if s, err := strconv.ParseUint(v, 10, 64); err == nil || errors.Is(err, strconv.ErrRange) {
		if s > math.MaxInt64/uint64(time.Second) {
			return math.MaxInt64
		}
		return time.Duration(s) * time.Second
	}
	if at, err := http.ParseTime(v); err == nil {
		return max(at.Sub(now), 0)
	}
	return 0
}

// sleep waits d, or until ctx ends, returning then its cause.
func sleep(ctx context.Context, d time.Duration) error {
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-timer.C:
		return nil
	case <-ctx.Done():
		return context.Cause(ctx)
	}
}
