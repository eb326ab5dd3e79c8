package linearizable

import (
	"testing"
	"time"

	"github.com/anishathalye/porcupine"

	"github.com/idempotency-go/idempotency"
)

// A call made from call to ret, in milliseconds of the model's clock.
type timed struct {
	call, ret int64
	in        input
	out       output
}

func claimOf(fp byte, opID string, leaseMS int64) input {
	return input{verb: claim, key: "k", fp: fp, opID: opID, lease: leaseMS * int64(time.Millisecond)}
}

func by(v verb, token uint64) input {
	return input{verb: v, key: "k", token: token, lease: 100 * int64(time.Millisecond), resp: "201 r"}
}

func owner(token uint64, opID string, attempt int, abandoned bool) output {
	return output{state: idempotency.Owner, token: token, opID: opID, attempt: attempt, abandoned: abandoned}
}

func busy(leftMS int64) output {
	return output{state: idempotency.InFlight, leaseLeft: leftMS * int64(time.Millisecond)}
}

var (
	ok      = output{}
	fenced  = output{fenced: true}
	unknown = output{unknown: true}
)

// TestModel checks the model's rules on histories made by hand, with the
// default skew of 5ms.
func TestModel(t *testing.T) {
	for _, c := range []struct {
		name         string
		calls        []timed
		linearizable bool
	}{
		{"ClaimsRace", []timed{
			{0, 10, claimOf('A', "a", 100), owner(1, "a", 1, false)},
			{0, 10, claimOf('A', "b", 100), busy(95)},
		}, true},
		{"TwoOwners", []timed{
			{0, 10, claimOf('A', "a", 100), owner(1, "a", 1, false)},
			{0, 10, claimOf('A', "b", 100), owner(2, "a", 2, true)},
		}, false},
		{"InFlightAfterTheLease", []timed{
			{0, 1, claimOf('A', "a", 100), owner(1, "a", 1, false)},
			{120, 121, claimOf('A', "b", 100), busy(10)},
		}, false},
		{"InFlightWithinTheSkew", []timed{
			{0, 1, claimOf('A', "a", 100), owner(1, "a", 1, false)},
			{104, 105, claimOf('A', "b", 100), busy(1)},
		}, true},
		{"LeaseLeftLongerThanTheLease", []timed{
			{0, 1, claimOf('A', "a", 100), owner(1, "a", 1, false)},
			{50, 51, claimOf('A', "b", 100), busy(80)},
		}, false},
		{"TakeoverBeforeTheLeaseRanOut", []timed{
			{0, 1, claimOf('A', "a", 100), owner(1, "a", 1, false)},
			{50, 51, claimOf('A', "b", 100), owner(2, "a", 2, true)},
		}, false},
		{"TakeoverFencesTheOldOwner", []timed{
			{0, 1, claimOf('A', "a", 100), owner(1, "a", 1, false)},
			{120, 121, claimOf('A', "b", 100), owner(2, "a", 2, true)},
			{130, 131, by(complete, 1), fenced},
			{140, 141, by(complete, 2), ok},
			{150, 151, claimOf('A', "c", 100), output{state: idempotency.Completed, opID: "a", resp: "201 r"}},
		}, true},
		{"StaleOwnerCompletes", []timed{
			{0, 1, claimOf('A', "a", 100), owner(1, "a", 1, false)},
			{120, 121, claimOf('A', "b", 100), owner(2, "a", 2, true)},
			{130, 131, by(complete, 1), ok},
		}, false},
		{"OwnerRenewsAfterItsLeaseRanOut", []timed{
			{0, 1, claimOf('A', "a", 100), owner(1, "a", 1, false)},
			{150, 151, by(heartbeat, 1), ok},
			{200, 201, claimOf('A', "b", 100), busy(50)},
		}, true},
		{"AbandonEndsTheLeaseNow", []timed{
			{0, 1, claimOf('A', "a", 100), owner(1, "a", 1, false)},
			{10, 11, by(abandon, 1), ok},
			{20, 21, claimOf('A', "b", 100), owner(2, "a", 2, true)},
		}, true},
		{"TakeoverOfAReleaseIsNotAbandoned", []timed{
			{0, 1, claimOf('A', "a", 100), owner(1, "a", 1, false)},
			{10, 11, by(release, 1), ok},
			{20, 21, claimOf('A', "b", 100), owner(2, "a", 2, true)},
		}, false},
		{"TokensGrowAfterForget", []timed{
			{0, 1, claimOf('A', "a", 100), owner(5, "a", 1, false)},
			{10, 11, by(forget, 5), ok},
			{20, 21, claimOf('A', "b", 100), owner(3, "b", 1, false)},
		}, false},
		{"WrongReplay", []timed{
			{0, 1, claimOf('A', "a", 100), owner(1, "a", 1, false)},
			{10, 11, by(complete, 1), ok},
			{20, 21, claimOf('A', "b", 100), output{state: idempotency.Completed, opID: "a", resp: "500 other"}},
		}, false},
		{"OtherFingerprint", []timed{
			{0, 1, claimOf('A', "a", 100), owner(1, "a", 1, false)},
			{10, 11, by(release, 1), ok},
			{20, 21, claimOf('B', "b", 100), owner(2, "a", 2, false)},
		}, false},
		{"LostCompletionMayHaveHappened", []timed{
			{0, 1, claimOf('A', "a", 100), owner(1, "a", 1, false)},
			{10, 11, by(complete, 1), unknown},
			{20, 21, claimOf('A', "b", 100), output{state: idempotency.Completed, opID: "a", resp: "201 r"}},
		}, true},
		{"LostCompletionMayNotHaveHappened", []timed{
			{0, 1, claimOf('A', "a", 100), owner(1, "a", 1, false)},
			{10, 11, by(complete, 1), unknown},
			{20, 21, claimOf('A', "b", 100), busy(80)},
		}, true},
		{"LostClaimMakesAnOwnerNoOneKnows", []timed{
			{0, 1, claimOf('A', "a", 100), unknown},
			{10, 11, claimOf('A', "b", 100), busy(90)},
			{200, 201, claimOf('A', "c", 100), owner(7, "a", 2, true)},
			{210, 211, by(complete, 7), ok},
		}, true},
		{"LostClaimCannotRemakeTheRecord", []timed{
			{0, 1, claimOf('A', "a", 100), unknown},
			{10, 11, claimOf('A', "b", 100), owner(3, "b", 1, false)},
			{20, 21, claimOf('A', "c", 100), owner(4, "a", 1, false)},
		}, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			h := &history{skew: int64(5 * time.Millisecond)}
			for i, tc := range c.calls {
				h.add(i, tc.in, tc.out, tc.call*int64(time.Millisecond), tc.ret*int64(time.Millisecond))
			}
			if got := porcupine.CheckOperations(model, h.ops); got != c.linearizable {
				t.Errorf("linearizable: %t, want %t", got, c.linearizable)
			}
		})
	}
}
