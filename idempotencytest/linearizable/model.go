package linearizable

import (
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/anishathalye/porcupine"

	"github.com/idempotency-go/idempotency"
)

// The model is the state machine of one record as the Store interface states
// it (store.go), written as a sequential specification for porcupine. Each
// key's calls are checked on their own, against a record that starts absent:
// linearizability is compositional, so a history is linearizable if each
// key's is.
//
// Time. A store judges leases by its own clock, which the checker cannot
// read. Each call carries the window in which the store can have served it,
// [from, to]: the call's start and return on this process's monotonic clock,
// widened on both sides by Options.Skew for the store's clock granularity
// (Redis counts whole milliseconds) and drift. The clocks' offset cancels
// out, since a lease is only ever compared with a later time of the same
// clock, so the model keeps a lease's end as bounds [leaseFrom, leaseTo] on
// this process's clock and accepts an answer if it is right for some store
// time in the call's window. The model does not require the store's times
// to grow from one call to the next in the order it picks: that makes it
// more lenient, never stricter.
//
// Unknown outcomes. A call that fails with ErrUnavailable may or may not have
// taken effect, at any time after it started: its window has no end (never),
// and the model lets it leave the record unchanged or as if it had taken
// effect, with any answer. A claim that may have made an owner whose token
// no caller learnt leaves token 0, which every owner's call is fenced by.
//
// Recovery points. A record in flight or released keeps its recovery points
// (idempotency.RecoveryPointStore) as one ordered list: a save by the owner
// appends its point unless the step has one, a read by the owner returns the
// list, and any other token is fenced. Release, Abandon, renewals and
// takeovers keep the list; Complete and Forget drop it, and a record made
// anew has none.
//
// Left out: retention (Check uses one that outlasts the history), Watch and
// Subscribe (wake-ups are a liveness matter), and ListAbandoned, which lists
// records across keys.

// never is the end of the window of a call whose outcome is unknown. It is far
// enough from math.MaxInt64 that adding a lease cannot overflow.
const never = math.MaxInt64 / 4

type verb uint8

const (
	claim verb = iota + 1
	complete
	release
	forget
	heartbeat
	abandon
	save   // RecoveryPointStore.SaveRecoveryPoint
	points // RecoveryPointStore.RecoveryPoints
)

var verbs = [...]string{claim: "claim", complete: "complete", release: "release",
	forget: "forget", heartbeat: "heartbeat", abandon: "abandon", save: "save", points: "points"}

func (v verb) String() string { return verbs[v] }

type phase uint8

const (
	absent phase = iota
	inFlight
	released
	completed
)

// record is the model's state of one record. It is a comparable value:
// porcupine keeps the states it explores and merges equal ones with ==.
type record struct {
	phase   phase
	fp      byte   // the fingerprint's label, 'A' or 'B'
	opID    string // from the claim that made the record
	attempt int
	// token is the owner's, or 0 when no caller learnt it: the claim that
	// made it failed with ErrUnavailable.
	token uint64
	// last is the greatest token a caller was given for this key: a new one
	// must be greater. It survives Forget, as tokens only grow per key.
	last uint64
	// leaseFrom and leaseTo bound the end of the owner's lease.
	leaseFrom, leaseTo int64
	resp               string // completed: the stored response, as describe writes it
	// points is the list of recovery points, in the order saved, as
	// pointList writes it; empty when completed or absent.
	points string
}

// input is one store call.
type input struct {
	verb verb
	key  string // the record's partition
	// from and to bound the store's clock when it served the call; to is
	// never when its outcome is unknown.
	from, to int64
	fp       byte   // claim
	opID     string // claim
	lease    int64  // claim, heartbeat
	token    uint64 // the owner's calls
	resp     string // complete
	step     string // save: the point's step and result
	result   string
}

// output is a call's answer.
type output struct {
	unknown bool // it failed with ErrUnavailable
	fenced  bool // an owner's call failed with ErrFenced

	// A claim's answer.
	state     idempotency.ClaimState
	opID      string
	attempt   int
	token     uint64
	abandoned bool
	resp      string
	leaseLeft int64

	// A read of the recovery points: the list, as pointList writes it.
	points string
}

// step returns the records that r can become through in answered by out;
// none when out is not an answer the contract allows.
func step(r record, in input, out output) []record {
	switch in.verb {
	case claim:
		return claimStep(r, in, out)
	case complete:
		if r.phase == completed && r.resp == in.resp && !out.fenced {
			// Its resend, or anyone's completion with the outcome stored:
			// the caller holds what is kept (see the Store contract).
			return []record{r}
		}
		return owned(r, in, out, func(r record) record {
			return record{phase: completed, fp: r.fp, opID: r.opID, last: r.last, resp: in.resp}
		})
	case release:
		return owned(r, in, out, func(r record) record {
			return record{phase: released, fp: r.fp, opID: r.opID, attempt: r.attempt, last: r.last, points: r.points}
		})
	case forget:
		return owned(r, in, out, func(r record) record { return record{last: r.last} })
	case heartbeat:
		return owned(r, in, out, func(r record) record {
			r.leaseFrom, r.leaseTo = in.from+in.lease, in.to+in.lease
			return r
		})
	case abandon:
		return owned(r, in, out, func(r record) record {
			r.leaseFrom, r.leaseTo = in.from, in.to
			return r
		})
	case save:
		return savePoint(r, in, out)
	case points:
		owns := r.phase == inFlight && r.token == in.token
		return unchanged(r, out.unknown || out.fenced && !owns || !out.fenced && owns && out.points == r.points)
	}
	return nil
}

// savePoint is a save by the owner of in.token: it appends its point to the
// record's list unless the list has one of its step, and changes nothing
// for any other token, which it is fenced by. ErrFenced to the owner means
// that the point was saved: a save resent after its reply was lost answers
// ErrFenced when the record was taken over in between, though its first
// send saved the point (see the Store contract); a save served while the
// token owned the record is never fenced.
func savePoint(r record, in input, out output) []record {
	owns := r.phase == inFlight && r.token == in.token
	next := r
	if owns {
		next.points = withPoint(r.points, in.step, in.result)
	}
	switch {
	case out.unknown && next != r:
		return []record{r, next}
	case out.unknown || out.fenced || owns:
		return []record{next}
	}
	return nil
}

// pointList writes a list of recovery points as the model keeps it: each
// step and result quoted, so that no two lists are written alike.
func pointList(ps []idempotency.RecoveryPoint) string {
	var b strings.Builder
	for _, p := range ps {
		b.WriteString(pointOf(p.Step, string(p.Result)))
	}
	return b.String()
}

func pointOf(step, result string) string {
	return strconv.Quote(step) + "=" + strconv.Quote(result) + ";"
}

// withPoint is list with the point of step appended, unless list has a
// point of step already. A quoted step followed by '=' starts a point: a
// quoted result holds no unescaped quote.
func withPoint(list, step, result string) string {
	at := strconv.Quote(step) + "="
	if strings.HasPrefix(list, at) || strings.Contains(list, ";"+at) {
		return list
	}
	return list + pointOf(step, result)
}

// owned is a call by the owner of token: it changes r if token owns the
// record, however long ago its lease ran out, and is fenced otherwise.
// Only Complete is exact about ErrFenced (and may succeed on a record that
// holds its response already): the Store contract lets a store whose client
// resends a call whose reply was lost answer ErrFenced to a Release,
// Forget, Heartbeat or Abandon that its first send applied, so for them
// ErrFenced means that the change may or may not have been made.
func owned(r record, in input, out output, change func(record) record) []record {
	token := in.token
	if out.fenced && in.verb != complete {
		out.fenced, out.unknown = false, true
	}
	owns := r.phase == inFlight && r.token == token
	switch {
	case out.unknown && owns:
		return []record{r, change(r)}
	case out.unknown || out.fenced && !owns:
		return []record{r}
	case !out.fenced && owns:
		return []record{change(r)}
	}
	return nil
}

func claimStep(r record, in input, out output) []record {
	if r.phase != absent && r.fp != in.fp {
		return unchanged(r, out.unknown || out.state == idempotency.Mismatch)
	}
	switch r.phase {
	case absent:
		return own(r, in, out, in.opID, 1, false)
	case completed:
		return unchanged(r, out.unknown || out.state == idempotency.Completed && out.opID == r.opID && out.resp == r.resp)
	case released:
		return own(r, in, out, r.opID, r.attempt+1, false)
	}
	// In flight: the lease may be live at some time of the call's window,
	// may have run out at some time of it, or both.
	var next []record
	if r.leaseTo > in.from {
		inflight := out.state == idempotency.InFlight && out.leaseLeft > 0 &&
			r.leaseFrom-in.to <= out.leaseLeft && out.leaseLeft <= r.leaseTo-in.from
		next = unchanged(r, out.unknown || inflight)
	}
	if r.leaseFrom <= in.to {
		next = append(next, own(r, in, out, r.opID, r.attempt+1, true)...)
	}
	return next
}

// own is a claim that makes its caller the owner of attempt, or when its
// outcome is unknown may have.
func own(r record, in input, out output, opID string, attempt int, abandoned bool) []record {
	// A takeover keeps the recovery points; an absent record has none, so
	// neither has one made anew.
	n := record{phase: inFlight, fp: in.fp, opID: opID, attempt: attempt, last: r.last,
		leaseFrom: in.from + in.lease, leaseTo: in.to + in.lease, points: r.points}
	switch {
	case out.unknown:
		return []record{r, n}
	case out.state != idempotency.Owner || out.opID != opID || out.attempt != attempt ||
		out.abandoned != abandoned || out.token <= r.last:
		return nil
	}
	n.token, n.last = out.token, out.token
	return []record{n}
}

func unchanged(r record, ok bool) []record {
	if ok {
		return []record{r}
	}
	return nil
}

// byKey partitions a history by the key of each operation's input.
func byKey(key func(in any) string) func([]porcupine.Operation) [][]porcupine.Operation {
	return func(history []porcupine.Operation) [][]porcupine.Operation {
		var keys []string
		ops := map[string][]porcupine.Operation{}
		for _, op := range history {
			k := key(op.Input)
			if ops[k] == nil {
				keys = append(keys, k)
			}
			ops[k] = append(ops[k], op)
		}
		parts := make([][]porcupine.Operation, len(keys))
		for i, k := range keys {
			parts[i] = ops[k]
		}
		return parts
	}
}

// model is the checker's model of a history's records, partitioned by key.
var model = (&porcupine.NondeterministicModel{
	Partition: byKey(func(in any) string { return in.(input).key }),
	Init:      func() []any { return []any{record{}} },
	Step: func(state, in, out any) []any {
		var next []any
		for _, r := range step(state.(record), in.(input), out.(output)) {
			next = append(next, r)
		}
		return next
	},
	DescribeOperation: func(in, out any) string { return describeCall(in.(input), out.(output)) },
	DescribeState:     func(state any) string { return describeRecord(state.(record)) },
}).ToModel()

func describeCall(in input, out output) string {
	var call string
	switch in.verb {
	case claim:
		call = fmt.Sprintf("%s claim %c %s lease %v", in.key, in.fp, in.opID, time.Duration(in.lease))
	case heartbeat:
		call = fmt.Sprintf("%s heartbeat #%d lease %v", in.key, in.token, time.Duration(in.lease))
	case save:
		call = fmt.Sprintf("%s save #%d %s", in.key, in.token, pointOf(in.step, in.result))
	default:
		call = fmt.Sprintf("%s %v #%d", in.key, in.verb, in.token)
	}
	answer := kind(in, out)
	switch answer {
	case "owner", "takeover":
		answer = fmt.Sprintf("owner #%d of %s, attempt %d, abandoned %t", out.token, out.opID, out.attempt, out.abandoned)
	case "in flight":
		answer = fmt.Sprintf("in flight, %v left", time.Duration(out.leaseLeft))
	case "completed":
		answer = fmt.Sprintf("completed %s: %s", out.opID, out.resp)
	case "ok":
		if in.verb == points {
			answer = "[" + out.points + "]"
		}
	}
	return call + " → " + answer
}

func describeRecord(r record) string {
	switch r.phase {
	case inFlight:
		return fmt.Sprintf("in flight %c %s #%d attempt %d, lease ends in [%v, %v], points [%s]",
			r.fp, r.opID, r.token, r.attempt, time.Duration(r.leaseFrom), time.Duration(r.leaseTo), r.points)
	case released:
		return fmt.Sprintf("released %c %s attempt %d, points [%s]", r.fp, r.opID, r.attempt, r.points)
	case completed:
		return fmt.Sprintf("completed %c %s: %s", r.fp, r.opID, r.resp)
	}
	return fmt.Sprintf("absent, last token #%d", r.last)
}
