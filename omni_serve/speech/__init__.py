"""Speech synthesis over the stages: text -> talker codes -> code2wav audio, streamed."""
