package faultsuite

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/idempotency-go/idempotency"
)

// stepNames are the steps, in their order, of the operations made of
// steps: those of every other key.
var stepNames = [...]string{"order", "charge", "receipt"}

// keyName is the name of the run's nth key: s… for an operation made of
// steps, k… for one without.
func keyName(n int) string {
	if n%2 == 1 {
		return "s" + strconv.Itoa(n)
	}
	return "k" + strconv.Itoa(n)
}

// stepwise says whether key names an operation made of steps.
func stepwise(key string) bool { return strings.HasPrefix(key, "s") }

// steps runs the steps of e's operation through idempotency.Step, each
// working for work, and returns the runs whose results they answered, as
// the response names them: "order=3,charge=4,receipt=9". A step's result
// is the id of the run of its function that Step recorded.
func (r *run) steps(ctx context.Context, e *execution, work time.Duration) (string, error) {
	refs := make([]string, 0, len(stepNames))
	for _, name := range stepNames {
		var ran *stepRun
		result, err := idempotency.Step(ctx, name, func(ctx context.Context) (int, error) {
			ran = r.l.stepBegin(e, name)
			if !sleep(ctx, work) {
				return 0, context.Cause(ctx)
			}
			r.l.stepEnd(ran)
			return ran.id, nil
		})
		if err != nil {
			return "", err
		}
		r.l.stepAnswered(e, name, result, ran)
		refs = append(refs, name+"="+strconv.Itoa(result))
	}
	return strings.Join(refs, ","), nil
}

// stepKey is one step of one key's operation.
type stepKey struct{ key, step string }

// countSteps counts what the faults cost the operations made of steps. A
// step that ran again once Step had confirmed the recording of an earlier
// run is a double execution. A result Step answered that is not a run of
// that step, or not the one result every answer for that step named, is a
// wrong answer, and so is a stored response whose steps did not each run
// to their end. l.mu is held.
func (l *ledger) countSteps(tl *tally, stored map[string]*execution) {
	confirmed := make(map[stepKey]*stepRun) // the earliest confirmed run
	for _, sr := range l.runs {
		k := stepKey{sr.exec.key, sr.step}
		if c := confirmed[k]; !sr.confirmed.IsZero() && (c == nil || sr.confirmed.Before(c.confirmed)) {
			confirmed[k] = sr
		}
	}
	tl.stepRuns = len(l.runs)
	for _, sr := range l.runs {
		if !sr.confirmed.IsZero() {
			tl.stepsConfirmed++
		}
		if c := confirmed[stepKey{sr.exec.key, sr.step}]; c != nil && sr.start.After(c.confirmed) {
			tl.doubles++
			tl.stepReruns++
			tl.problem("%s: step %s ran again (run %d, attempt %d), %v after Step confirmed the recording of run %d (attempt %d)",
				sr.exec.key, sr.step, sr.id, sr.exec.attempt, sr.start.Sub(c.confirmed), c.id, c.exec.attempt)
		}
	}
	l.countStepAnswers(tl)
	for key, e := range stored {
		if !stepwise(key) {
			continue
		}
		if err := l.stepsRan(key, e.body); err != nil {
			tl.wrong++
			tl.problem("%s: the stored response of execution %d: %v", key, e.id, err)
		}
	}
}

// countStepAnswers checks the results Step answered: each is a run of its
// step that ran to its end, and all answers for one step name the same
// run. l.mu is held.
func (l *ledger) countStepAnswers(tl *tally) {
	recorded := make(map[stepKey]int)
	for _, a := range l.answers {
		k := stepKey{a.exec.key, a.step}
		if err := l.stepRan(k, a.result); err != nil {
			tl.wrong++
			tl.problem("%s: Step answered step %s of execution %d with %v", k.key, k.step, a.exec.id, err)
			continue
		}
		if l.runs[a.result].exec != a.exec {
			tl.stepReplays++
		}
		if first, ok := recorded[k]; ok && first != a.result {
			tl.wrong++
			tl.problem("%s: Step answered step %s with the results of runs %d and %d (execution %d)", k.key, k.step, first, a.result, a.exec.id)
			continue
		}
		recorded[k] = a.result
	}
}

// stepsRan checks that body, a response of key's operation, names a run
// of each of its steps that ran to its end. l.mu is held.
func (l *ledger) stepsRan(key, body string) error {
	parts := strings.SplitN(body, "|", 3)
	if len(parts) < 3 {
		return fmt.Errorf("the body %.40q names no steps", body)
	}
	refs := strings.Split(parts[1], ",")
	if len(refs) != len(stepNames) {
		return fmt.Errorf("the body names the steps %q, want %d", parts[1], len(stepNames))
	}
	for i, ref := range refs {
		id, err := strconv.Atoi(strings.TrimPrefix(ref, stepNames[i]+"="))
		if err != nil {
			return fmt.Errorf("the body names the steps %q, want %v in order", parts[1], stepNames)
		}
		if err := l.stepRan(stepKey{key, stepNames[i]}, id); err != nil {
			return fmt.Errorf("step %s: %w", stepNames[i], err)
		}
	}
	return nil
}

// stepRan checks that id is a run of k's step that ran to its end. l.mu
// is held.
func (l *ledger) stepRan(k stepKey, id int) error {
	switch {
	case id < 0 || id >= len(l.runs):
		return fmt.Errorf("result %d, which is no run's", id)
	case l.runs[id].exec.key != k.key || l.runs[id].step != k.step:
		return fmt.Errorf("run %d, which is step %s of %s", id, l.runs[id].step, l.runs[id].exec.key)
	case !l.runs[id].finished:
		return fmt.Errorf("run %d, which was cut short", id)
	}
	return nil
}
