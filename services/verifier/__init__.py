"""The verifier deployment: target model, scheduler loop, acceptance; talks to its drafter."""
