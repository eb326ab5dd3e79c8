package linearizable_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
	"github.com/stretchr/testify/assert"

	"github.com/idempotency-go/idempotency/idempotencytest/linearizable"
)

// The one-commit mode's model: what Guard.Do over an idempotency.Transactor
// (postgres.OneCommit) may answer, as a sequential specification of one
// key, for porcupine. The record and the operation's business row commit
// in one transaction, so the key has two states only: absent, or committed
// once and for all with the fingerprint and operation ID of the call that
// committed it (the history outlasts no retention). Within one transaction
// nobody sees a record in flight: a duplicate waits on the row's lock.
//
// Each Do is one call, linearized where its transaction's commit (or, for
// an answer that changes nothing, its claim) took effect:
//
//   - owner: the key was absent; it is now committed with the call's
//     fingerprint and the operation ID its operation ran with, and the
//     answer names that ID in its body;
//   - replay: committed with the call's fingerprint; the answer is the
//     committed operation's;
//   - mismatch: committed with the other fingerprint;
//   - in flight (the wait ran out on the row's lock, held by an
//     uncommitted claim), failed (the operation's own error: the
//     transaction rolled back) and released (the operation chose Release:
//     nothing kept): the key was absent, and stays so;
//   - unknown (ErrUnavailable: the commit may have been applied and its
//     reply lost): nothing, or, if its operation ran and the key was
//     absent, the key committed with its fingerprint and operation ID, at
//     any time after it started. A call whose operation did not run cannot
//     have committed anything.
//
// Besides the calls, the history holds two kinds of observation:
//
//   - ran: a call's operation ran, so its claim found the key absent, some
//     time between the call's start and the operation's;
//   - read: one statement (one snapshot) read the key's record and the
//     operation IDs of the key's business rows. Absent: no record and no
//     business row. Committed: the record, with a response, and exactly one
//     business row, the committed operation's. Every key gets a final read
//     once the clients stopped, which settles each unknown outcome and
//     checks that no business row was committed without its record, or
//     twice.

// never ends the window of a call whose outcome is unknown.
const ocNever = linearizable.Never

type ocKind uint8

const (
	ocDo ocKind = iota + 1
	ocRan
	ocRead
)

type ocAnswer uint8

const (
	ocOwner ocAnswer = iota + 1
	ocReplay
	ocMismatch
	ocInFlight
	ocFailed
	ocReleased
	ocUnknown
)

var ocAnswers = [...]string{ocOwner: "owner", ocReplay: "replay", ocMismatch: "mismatch",
	ocInFlight: "in flight", ocFailed: "failed", ocReleased: "released", ocUnknown: "unknown"}

func (a ocAnswer) String() string { return ocAnswers[a] }

// ocIn is one call or observation of one key.
type ocIn struct {
	kind ocKind
	key  string
	fp   byte // do, ran: the request's fingerprint, 'A' or 'B'
	// opID is, for do and ran, the operation ID the call's operation ran
	// with, or "" when it did not run.
	opID string
}

// ocOut is its answer.
type ocOut struct {
	answer ocAnswer // do
	opID   string   // do: Result.OperationID
	status int      // do: the response's
	body   string

	// read: the record's fingerprint (0: no record), operation ID and
	// whether it holds a response, and the business rows' operation IDs,
	// sorted, comma-separated.
	recFP    byte
	recOpID  string
	recResp  bool
	business string
}

// ocRecord is the model's state of a key: fp 0 when absent.
type ocRecord struct {
	fp   byte
	opID string
}

// ocBody is the body of the response of the operation that ran with opID.
func ocBody(opID string) string { return "charged by " + opID }

const ocStatus = 201

func ocStep(r ocRecord, in ocIn, out ocOut) []ocRecord {
	absent := r.fp == 0
	same := func(ok bool) []ocRecord {
		if ok {
			return []ocRecord{r}
		}
		return nil
	}
	switch in.kind {
	case ocRan:
		return same(absent)
	case ocRead:
		if absent {
			return same(out.recFP == 0 && out.recOpID == "" && !out.recResp && out.business == "")
		}
		return same(out.recFP == r.fp && out.recOpID == r.opID && out.recResp && out.business == r.opID)
	}
	answered := out.opID == in.opID && out.status == ocStatus && out.body == ocBody(in.opID)
	switch out.answer {
	case ocOwner:
		if absent && in.opID != "" && answered {
			return []ocRecord{{fp: in.fp, opID: in.opID}}
		}
		return nil
	case ocReplay:
		return same(!absent && r.fp == in.fp && out.opID == r.opID && out.status == ocStatus && out.body == ocBody(r.opID))
	case ocMismatch:
		return same(!absent && r.fp != in.fp)
	case ocInFlight:
		return same(absent)
	case ocFailed:
		return same(absent && in.opID != "")
	case ocReleased:
		return same(absent && in.opID != "" && answered)
	case ocUnknown:
		if absent && in.opID != "" {
			return []ocRecord{r, {fp: in.fp, opID: in.opID}}
		}
		return []ocRecord{r}
	}
	return nil
}

var ocModel = (&porcupine.NondeterministicModel{
	Partition: linearizable.ByKey(func(in any) string { return in.(ocIn).key }),
	Init:      func() []any { return []any{ocRecord{}} },
	Step: func(state, in, out any) []any {
		var next []any
		for _, r := range ocStep(state.(ocRecord), in.(ocIn), out.(ocOut)) {
			next = append(next, r)
		}
		return next
	},
	DescribeOperation: func(in, out any) string { return ocDescribe(in.(ocIn), out.(ocOut)) },
	DescribeState: func(state any) string {
		r := state.(ocRecord)
		if r.fp == 0 {
			return "absent"
		}
		return fmt.Sprintf("committed %c %s", r.fp, r.opID)
	},
}).ToModel()

func ocDescribe(in ocIn, out ocOut) string {
	switch in.kind {
	case ocRan:
		return fmt.Sprintf("%s %c ran %s", in.key, in.fp, in.opID)
	case ocRead:
		if out.recFP == 0 {
			return fmt.Sprintf("%s read → no record, business rows [%s]", in.key, out.business)
		}
		return fmt.Sprintf("%s read → %c %s, response %t, business rows [%s]",
			in.key, out.recFP, out.recOpID, out.recResp, out.business)
	}
	call := fmt.Sprintf("%s do %c", in.key, in.fp)
	if in.opID != "" {
		call += " ran " + in.opID
	}
	switch out.answer {
	case ocOwner, ocReplay, ocReleased:
		return fmt.Sprintf("%s → %v %s: %d %q", call, out.answer, out.opID, out.status, out.body)
	}
	return fmt.Sprintf("%s → %v", call, out.answer)
}

// The model must refuse each way the one-commit mode could break
// exactly-once, and accept what it allows, unknown outcomes included.
func TestOneCommitModel(t *testing.T) {
	type call struct {
		call, ret int64
		in        ocIn
		out       ocOut
	}
	do := func(fp byte, opID string, a ocAnswer, answered string) (ocIn, ocOut) {
		out := ocOut{answer: a}
		if answered != "" {
			out.opID, out.status, out.body = answered, ocStatus, ocBody(answered)
		}
		return ocIn{kind: ocDo, key: "k", fp: fp, opID: opID}, out
	}
	ran := func(fp byte, opID string) ocIn { return ocIn{kind: ocRan, key: "k", fp: fp, opID: opID} }
	read := ocIn{kind: ocRead, key: "k"}
	seen := func(fp byte, opID string, resp bool, business string) ocOut {
		return ocOut{recFP: fp, recOpID: opID, recResp: resp, business: business}
	}
	op := func(from, to int64, in ocIn, out ocOut) call { return call{from, to, in, out} }
	withDo := func(from, to int64, fp byte, opID string, a ocAnswer, answered string) call {
		in, out := do(fp, opID, a, answered)
		return call{from, to, in, out}
	}
	for _, c := range []struct {
		name  string
		ok    bool
		calls []call
	}{
		{"OwnerThenReplays", true, []call{
			op(0, 5, ran('A', "o1"), ocOut{}), withDo(0, 10, 'A', "o1", ocOwner, "o1"),
			withDo(2, 12, 'A', "", ocReplay, "o1"), withDo(11, 13, 'B', "", ocMismatch, ""),
			op(20, 21, read, seen('A', "o1", true, "o1"))}},
		{"UnknownCommitted", true, []call{
			op(0, 1, ran('A', "o1"), ocOut{}), withDo(0, ocNever, 'A', "o1", ocUnknown, ""),
			withDo(5, 8, 'A', "", ocReplay, "o1"), op(20, 21, read, seen('A', "o1", true, "o1"))}},
		{"UnknownRolledBack", true, []call{
			op(0, 1, ran('A', "o1"), ocOut{}), withDo(0, ocNever, 'A', "o1", ocUnknown, ""),
			op(4, 5, ran('A', "o2"), ocOut{}), withDo(3, 8, 'A', "o2", ocOwner, "o2"),
			op(20, 21, read, seen('A', "o2", true, "o2"))}},
		{"WaitsOutAnOwnerThatFailed", true, []call{
			op(0, 1, ran('A', "o1"), ocOut{}), withDo(0, 4, 'A', "o1", ocFailed, ""),
			withDo(1, 3, 'A', "", ocInFlight, ""), withDo(1, 6, 'B', "", ocInFlight, ""),
			op(5, 6, ran('B', "o2"), ocOut{}), withDo(5, 9, 'B', "o2", ocReleased, "o2"),
			op(20, 21, read, seen(0, "", false, ""))}},

		{"TwoOwners", false, []call{
			withDo(0, 10, 'A', "o1", ocOwner, "o1"), withDo(0, 10, 'A', "o2", ocOwner, "o2")}},
		{"ReplayOfAnother", false, []call{
			withDo(0, 10, 'A', "o1", ocOwner, "o1"), withDo(11, 12, 'A', "", ocReplay, "o2")}},
		{"OwnerAfterAReplay", false, []call{
			// The unknown call may have committed; then nobody may own
			// the key after a replay was answered, in real time.
			withDo(0, ocNever, 'A', "o1", ocUnknown, ""), withDo(1, 5, 'A', "", ocReplay, "o1"),
			withDo(6, 9, 'A', "o2", ocOwner, "o2")}},
		{"RanAfterACommit", false, []call{
			withDo(0, 5, 'A', "o1", ocOwner, "o1"), op(6, 7, ran('A', "o2"), ocOut{}),
			withDo(6, ocNever, 'A', "o2", ocUnknown, "")}},
		{"MismatchOfTheSameRequest", false, []call{
			withDo(0, 5, 'A', "o1", ocOwner, "o1"), withDo(6, 7, 'A', "", ocMismatch, "")}},
		{"MismatchOfNothing", false, []call{
			withDo(0, 5, 'A', "", ocMismatch, ""), op(6, 7, read, seen(0, "", false, ""))}},
		{"InFlightAfterACommit", false, []call{
			withDo(0, 5, 'A', "o1", ocOwner, "o1"), withDo(6, 7, 'A', "", ocInFlight, "")}},
		{"CommittedWithoutRunning", false, []call{
			withDo(0, ocNever, 'A', "", ocUnknown, ""), op(6, 7, read, seen('A', "o1", true, "o1"))}},
		{"BusinessRowTwice", false, []call{
			withDo(0, 5, 'A', "o1", ocOwner, "o1"), op(6, 7, read, seen('A', "o1", true, "o1,o1"))}},
		{"BusinessRowWithoutRecord", false, []call{
			withDo(0, ocNever, 'A', "o1", ocUnknown, ""), op(6, 7, read, seen(0, "", false, "o1"))}},
		{"RecordWithoutBusinessRow", false, []call{
			withDo(0, 5, 'A', "o1", ocOwner, "o1"), op(6, 7, read, seen('A', "o1", true, ""))}},
		{"RolledBackOwnerSeen", false, []call{
			withDo(0, 5, 'A', "o1", ocFailed, ""), op(6, 7, read, seen('A', "o1", true, "o1"))}},
		{"OwnerAnswerOfAnotherOperation", false, []call{
			withDo(0, 5, 'A', "o1", ocOwner, "o9")}},
	} {
		t.Run(c.name, func(t *testing.T) {
			var ops []porcupine.Operation
			for i, cl := range c.calls {
				ops = append(ops, porcupine.Operation{ClientId: i, Input: cl.in, Call: cl.call, Output: cl.out, Return: cl.ret})
			}
			want := porcupine.Illegal
			if c.ok {
				want = porcupine.Ok
			}
			assert.Equal(t, want, porcupine.CheckOperationsTimeout(ocModel, ops, 10*time.Second))
		})
	}
}
