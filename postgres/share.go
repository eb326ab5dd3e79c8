package postgres

import "sync/atomic"

// share estimates how often an outcome has come up among recent trials: an
// exponentially weighted average over about the last 16, in 1/1024ths. Its
// updates are atomic but not serialized: one lost to a concurrent update
// leaves the estimate a trial behind, which is harmless.
type share struct{ v atomic.Int32 }

// add counts a trial in which the outcome came up, or did not.
func (s *share) add(came bool) {
	x := int32(0)
	if came {
		x = 1024
	}
	v := s.v.Load()
	s.v.Store(v + (x-v)/16)
}

// most reports that the outcome came up in more than half of the recent
// trials.
func (s *share) most() bool { return s.v.Load() > 512 }
