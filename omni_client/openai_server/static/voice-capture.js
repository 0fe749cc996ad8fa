// The web demo's voice mode: an AudioWorklet that hands the microphone's samples to the page
// in 40 ms frames (960 samples at the 24 kHz of the page's AudioContext). Loaded by app.js.
"use strict";

class VoiceCapture extends AudioWorkletProcessor {
  constructor() {
    super();
    this.frame = new Float32Array(960);
    this.filled = 0;
  }

  process(inputs) {
    const channel = inputs[0] && inputs[0][0];
    if (channel) {
      for (let i = 0; i < channel.length; i++) {
        this.frame[this.filled++] = channel[i];
        if (this.filled === this.frame.length) {
          this.port.postMessage(this.frame.slice());
          this.filled = 0;
        }
      }
    }
    return true;
  }
}

registerProcessor("voice-capture", VoiceCapture);
