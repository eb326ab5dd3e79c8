package postgres

import "testing"

func TestShare(t *testing.T) {
	var s share
	if s.most() {
		t.Fatal("no trials: most")
	}
	flips := func(came bool) int {
		for n := 1; n <= 100; n++ {
			s.add(came)
			if s.most() == came {
				return n
			}
		}
		t.Fatalf("100 trials of %v did not make most %v", came, came)
		return 0
	}
	// Up and down in about a dozen trials, from either steady state.
	for range 3 {
		for _, came := range []bool{true, false} {
			if n := flips(came); n < 8 || n > 16 {
				t.Errorf("most became %v after %d trials of %v, want 8 to 16", came, n, came)
			}
			for range 50 {
				s.add(came)
			}
		}
	}
	// Mixed half and half it stays near a half, either side.
	for i := range 200 {
		s.add(i%2 == 0)
	}
	if v := s.v.Load(); v < 400 || v > 624 {
		t.Errorf("alternating trials: %d/1024, want near 512", v)
	}
}
