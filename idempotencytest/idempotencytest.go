// Package idempotencytest is the conformance suite that every
// idempotency.Store passes. It checks the record's state machine (see the
// Store interface): claims, takeovers, fencing, retention, wake-ups, the
// atomicity of concurrent claims, abandoned records and their listing, and
// the Guard running on top of the store, also once the store stops answering.
//
// A store's test calls Run:
//
//	func TestConformance(t *testing.T) {
//		idempotencytest.Run(t, func(t *testing.T) idempotencytest.Harness {
//			return idempotencytest.Harness{Store: newStore(t)}
//		})
//	}
package idempotencytest

import (
	"testing"
	"time"

	"github.com/idempotency-go/idempotency"
)

// Harness is what the suite needs from one store under test.
type Harness struct {
	// Store is the store under test.
	Store idempotency.Store
	// Advance moves every clock by which Store judges leases and retention
	// forward by d (a MemoryStore's MemoryOptions.Now; for miniredis both
	// SetTime, which TIME follows, and FastForward, which expires keys). The
	// suite calls it from the case's goroutine, between store calls, never
	// while cases run in parallel. Nil: the suite waits in real time, with
	// leases of 300ms, about 3.5s in all.
	Advance func(d time.Duration)
}

// Run runs every conformance case as a subtest of t. It calls newHarness
// once per case, with the case's t; it may return a fresh store or the same
// one every time: every case uses keys of its own.
//
// Besides the Store interface's contract, the suite holds a store to what
// callers of it rely on: Complete keeps a copy of the response, so the
// caller may reuse its buffers; a wake-up is kept for a subscriber that is
// not reading C when it comes; Subscription.Close may be called more than
// once. Tokens are compared only within one key.
func Run(t *testing.T, newHarness func(t *testing.T) Harness) {
	// The cases run in this order. Each one's doc comment states the clause
	// of the contract it checks; the files claim.go, settle.go, lease.go,
	// retention.go, wakeup.go, guard.go, abandoned.go, inspect.go, steps.go and history.go group them by
	// topic.
	cases := []struct {
		name string
		run  func(*env)
	}{
		{"ClaimCreatesRecord", claimCreatesRecord},
		{"InFlightWhileLeaseLive", inFlightWhileLeaseLive},
		{"FingerprintMismatch", fingerprintMismatch},
		{"CompleteThenReplay", completeThenReplay},
		{"TakeoverAfterLeaseExpiry", takeoverAfterLeaseExpiry},
		{"ReleaseThenClaim", releaseThenClaim},
		{"Fencing", fencing},
		{"HeartbeatExtendsLease", heartbeatExtendsLease},
		{"Retention", retention},
		{"TakeoverExtendsRetention", takeoverExtendsRetention},
		{"RenewalOutlivesRetention", renewalOutlivesRetention},
		{"RenewedRecordIsAbandonedAfterItsLease", renewedRecordIsAbandonedAfterItsLease},
		{"WakeUp", wakeUp},
		{"ConcurrentClaims", concurrentClaims},
		{"Guard", guard},
		{"KeysAndScopes", keysAndScopes},
		{"AbandonedTakeover", abandonedTakeover},
		{"GiveUpLease", giveUpLease},
		{"AbandonedListing", abandonedListing},
		{"SilentStoreStopsOwner", silentStoreStopsOwner},
		{"Inspection", inspection},
		{"OperatorActions", operatorActions},
		{"RecoveryPoints", recoveryPoints},
		{"RefusalKeepsOperation", refusalKeepsOperation},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			c.run(newEnv(t, newHarness(t)))
		})
	}
}
