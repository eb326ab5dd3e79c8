package idempotency

import (
	"math/rand/v2"
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
