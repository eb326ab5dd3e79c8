package linearizable

import (
	"strconv"
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

// saving is a save of step's point by the owner of token, with a result
// that names both.
func saving(token uint64, step string) input {
	return input{verb: save, key: "k", token: token, step: step, result: step + " by " + strconv.FormatUint(token, 10)}
}

// read is a read of the points by the owner of token.
func read(token uint64) input { return input{verb: points, key: "k", token: token} }

// list is the answer of a read that found the points of steps, saved with
// the tokens paired with them: list(1, "a", 2, "b").
func list(pairs ...any) output {
	var ps []idempotency.RecoveryPoint
	for i := 0; i < len(pairs); i += 2 {
		token, step := pairs[i].(int), pairs[i+1].(string)
		ps = append(ps, idempotency.RecoveryPoint{Step: step, Result: []byte(step + " by " + strconv.Itoa(token))})
	}
	return output{points: pointList(ps)}
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
		t.Run(c.name, func(t *testing.T) { checkHistory(t, c.calls, c.linearizable) })
	}
}

// TestModelRecoveryPoints checks the model's rules for recovery points on
// histories made by hand.
func TestModelRecoveryPoints(t *testing.T) {
	for _, c := range []struct {
		name         string
		calls        []timed
		linearizable bool
	}{
		{"KeptInOrderOnceAStep", []timed{
			{0, 1, claimOf('A', "a", 100), owner(1, "a", 1, false)},
			{2, 3, read(1), list()},
			{10, 11, saving(1, "x"), ok},
			{20, 21, saving(1, "y"), ok},
			{30, 31, saving(1, "x"), ok},
			{40, 41, read(1), list(1, "x", 1, "y")},
		}, true},
		{"OrderChanged", []timed{
			{0, 1, claimOf('A', "a", 100), owner(1, "a", 1, false)},
			{10, 11, saving(1, "x"), ok},
			{20, 21, saving(1, "y"), ok},
			{40, 41, read(1), list(1, "y", 1, "x")},
		}, false},
		{"ASecondSaveOfAStepReplacesIt", []timed{
			{0, 1, claimOf('A', "a", 100), owner(1, "a", 1, false)},
			{10, 11, saving(1, "x"), ok},
			{20, 21, by(release, 1), ok},
			{30, 31, claimOf('A', "b", 100), owner(2, "a", 2, false)},
			{40, 41, saving(2, "x"), ok},
			{50, 51, read(2), list(2, "x")},
		}, false},
		{"KeptThroughReleaseAbandonAndTakeover", []timed{
			{0, 1, claimOf('A', "a", 100), owner(1, "a", 1, false)},
			{10, 11, saving(1, "x"), ok},
			{20, 21, by(release, 1), ok},
			{30, 31, claimOf('A', "b", 100), owner(2, "a", 2, false)},
			{40, 41, saving(2, "y"), ok},
			{50, 51, by(abandon, 2), ok},
			{60, 61, claimOf('A', "c", 100), owner(3, "a", 3, true)},
			{70, 71, read(3), list(1, "x", 2, "y")},
			{200, 201, claimOf('A', "d", 100), owner(4, "a", 4, true)},
			{210, 211, read(4), list(1, "x", 2, "y")},
		}, true},
		{"LostOnRelease", []timed{
			{0, 1, claimOf('A', "a", 100), owner(1, "a", 1, false)},
			{10, 11, saving(1, "x"), ok},
			{20, 21, by(release, 1), ok},
			{30, 31, claimOf('A', "b", 100), owner(2, "a", 2, false)},
			{40, 41, read(2), list()},
		}, false},
		{"SurvivingAForget", []timed{
			{0, 1, claimOf('A', "a", 100), owner(1, "a", 1, false)},
			{10, 11, saving(1, "x"), ok},
			{20, 21, by(forget, 1), ok},
			{30, 31, claimOf('A', "b", 100), owner(2, "b", 1, false)},
			{40, 41, read(2), list(1, "x")},
		}, false},
		{"StaleOwnerSaves", []timed{
			{0, 1, claimOf('A', "a", 100), owner(1, "a", 1, false)},
			{10, 11, by(release, 1), ok},
			{20, 21, claimOf('A', "b", 100), owner(2, "a", 2, false)},
			{30, 31, saving(1, "x"), ok},
		}, false},
		{"StaleOwnerFenced", []timed{
			{0, 1, claimOf('A', "a", 100), owner(1, "a", 1, false)},
			{10, 11, by(release, 1), ok},
			{20, 21, claimOf('A', "b", 100), owner(2, "a", 2, false)},
			{30, 31, saving(1, "x"), fenced},
			{40, 41, read(1), fenced},
			{50, 51, read(2), list()},
		}, true},
		{"StaleOwnerReads", []timed{
			{0, 1, claimOf('A', "a", 100), owner(1, "a", 1, false)},
			{10, 11, by(release, 1), ok},
			{20, 21, claimOf('A', "b", 100), owner(2, "a", 2, false)},
			{30, 31, read(1), list()},
		}, false},
		{"OwnerFencedFromItsRead", []timed{
			{0, 1, claimOf('A', "a", 100), owner(1, "a", 1, false)},
			{10, 11, read(1), fenced},
		}, false},
		{"OwnersFencedSaveWasMade", []timed{
			{0, 1, claimOf('A', "a", 100), owner(1, "a", 1, false)},
			{10, 11, saving(1, "x"), fenced},
			{20, 21, by(release, 1), ok},
			{30, 31, claimOf('A', "b", 100), owner(2, "a", 2, false)},
			{40, 41, read(2), list()},
		}, false},
		{"LostSaveMayHaveHappened", []timed{
			{0, 1, claimOf('A', "a", 100), owner(1, "a", 1, false)},
			{10, 11, saving(1, "x"), unknown},
			{20, 21, read(1), list(1, "x")},
			{30, 31, saving(1, "y"), unknown},
			{40, 41, read(1), list(1, "x")},
		}, true},
		{"LostSaveLandsOnlyWhileItsOwnerOwns", []timed{
			{0, 1, claimOf('A', "a", 100), owner(1, "a", 1, false)},
			{10, 11, by(release, 1), ok},
			{20, 21, claimOf('A', "b", 100), owner(2, "a", 2, false)},
			{30, 31, saving(1, "x"), unknown},
			{40, 41, read(2), list(1, "x")},
		}, false},
		{"FencedOnceCompleted", []timed{
			{0, 1, claimOf('A', "a", 100), owner(1, "a", 1, false)},
			{10, 11, saving(1, "x"), ok},
			{20, 21, by(complete, 1), ok},
			{30, 31, saving(1, "y"), fenced},
			{40, 41, read(1), fenced},
		}, true},
		{"LostClaimsOwnerKeepsThePoints", []timed{
			{0, 1, claimOf('A', "a", 100), owner(1, "a", 1, false)},
			{10, 11, saving(1, "x"), ok},
			{20, 21, by(abandon, 1), ok},
			{30, 31, claimOf('A', "b", 100), unknown},
			{200, 201, claimOf('A', "c", 100), owner(3, "a", 3, true)},
			{210, 211, read(3), list(1, "x")},
		}, true},
	} {
		t.Run(c.name, func(t *testing.T) { checkHistory(t, c.calls, c.linearizable) })
	}
}

// checkHistory checks calls against the model, with the default skew of 5ms.
func checkHistory(t *testing.T, calls []timed, linearizable bool) {
	t.Helper()
	h := &history{skew: int64(5 * time.Millisecond)}
	for i, tc := range calls {
		h.add(i, tc.in, tc.out, tc.call*int64(time.Millisecond), tc.ret*int64(time.Millisecond))
	}
	if got := porcupine.CheckOperations(model, h.ops); got != linearizable {
		t.Errorf("linearizable: %t, want %t", got, linearizable)
	}
}
